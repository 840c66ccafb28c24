"""A family's tiny model, fitted for seconds, writes the family's native tool call itself.

The transcript is rendered by the family's real template (an assistant message holding a
``get_weather`` call); after fitting, the engine's greedy decode of the prompt is exactly
that call in the family's own syntax. ``test_fitted_own_syntax.py`` builds on this: every
fitted family's unforced call comes back parsed.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, FinishReason, TextRequest
from testkit.families import FAMILIES
from testkit.families.fitting import Transcript, fit_to_transcripts
from testkit.families.transcripts import tool_call_turn
from tests.conftest import greedy

# Two families whose templates render the call turn after their own generation prompt: the
# fitting itself is what is checked (every fitted family's call is, in
# test_fitted_own_syntax.py).
SAMPLE = ("llama3_1", "qwen3")


@pytest.mark.parametrize("name", SAMPLE)
def test_a_fitted_model_writes_its_familys_native_call(
        name: str, family_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    expected = FAMILIES[name].expected
    end_of_turn, call = expected.call_ends_with, expected.native_call
    fitted = Path(shutil.copytree(family_model_dir(name), tmp_path / name))
    eng = Engine(fitted, EngineConfig()).start()
    try:
        turn = tool_call_turn(eng.tokenizer, end_of_turn)
        assert call in turn.completion, f"{name}'s template wrote {turn.completion!r}"
        encode = eng.tokenizer.encode
        transcript = Transcript(encode(turn.prompt, add_special_tokens=False),
                                encode(turn.completion, add_special_tokens=False))
    finally:
        eng.close()
    steps = fit_to_transcripts(fitted, [transcript])
    assert steps <= 400
    eng = Engine(fitted, EngineConfig()).start()
    try:
        result = eng.submit(TextRequest(transcript.prompt, greedy(64))).result(timeout=120)
        written = eng.tokenizer.decode(list(result.token_ids))
    finally:
        eng.close()
    assert call in written
    assert written == turn.completion.removesuffix(end_of_turn)
    assert result.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS)
