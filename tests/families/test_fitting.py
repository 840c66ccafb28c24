"""A family's tiny model, fitted for seconds, writes the family's native tool call itself.

The transcript is rendered by the family's real template (an assistant message holding a
``get_weather`` call); after fitting, the engine's greedy decode of the prompt is exactly
that call in the family's own syntax. Later tests build on this to check that each family's
calls are parsed (qwen3's ``<tool_call>`` JSON is; Llama 3.1's JSON stays content today).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, FinishReason, TextRequest
from testkit.families.fitting import Transcript, fit_to_transcripts
from testkit.families.transcripts import tool_call_turn
from tests.conftest import greedy

NATIVE = {
    "qwen3": ("<|im_end|>",
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "llama3_1": ("<|eot_id|>", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_a_fitted_model_writes_its_familys_native_call(
        name: str, family_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    end_of_turn, call = NATIVE[name]
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
