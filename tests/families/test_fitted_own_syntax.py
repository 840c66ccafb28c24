"""A fitted family model writes its own native call unforced, and the engine reads it back.

Each tiny model is fitted for seconds on one transcript: the real template's prompt for a
question with a ``get_weather`` tool, then the call as the family writes it. Through the
Engine, a chat request with that tool (``tool_choice`` auto) then comes back as the parsed
call, finish_reason tool_calls, with no markup left in the content.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import ChatRequest, Engine, EngineConfig, FinishReason
from testkit.families.fitting import Transcript, fit_to_transcripts
from testkit.families.transcripts import QUESTION, WEATHER_TOOL, tool_call_turn
from tests.conftest import greedy

# family -> (end of turn, the raw completion where the template cannot render it after
# its own generation prompt, else None).
NATIVE = {
    # The prompt opened <think>: the template closes an empty block before the call.
    "qwen3_5": ("<|im_end|>", None),
    # The generation prompt closes an empty thought channel the history render does not
    # write, so the completion is given; <turn|> ends the turn (an end-of-sequence token).
    "gemma4": ("<turn|>", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                          "<turn|>"),
    # The template's own rendering: the recipient before the channel, <|call|> ends it.
    "gpt_oss": ("<|call|>", None),
    # LFM2's template renders no calls: its documented form.
    "lfm2": ("<|im_end|>", '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'
                           "<|im_end|>"),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_a_fitted_model_s_native_call_is_parsed(
        name: str, family_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    end_of_turn, raw = NATIVE[name]
    fitted = Path(shutil.copytree(family_model_dir(name), tmp_path / name))
    eng = Engine(fitted, EngineConfig()).start()
    try:
        turn = tool_call_turn(eng.tokenizer, end_of_turn, raw_completion=raw)
        encode = eng.tokenizer.encode
        transcript = Transcript(encode(turn.prompt, add_special_tokens=False),
                                encode(turn.completion, add_special_tokens=False))
    finally:
        eng.close()
    fit_to_transcripts(fitted, [transcript])
    eng = Engine(fitted, EngineConfig()).start()
    try:
        request = ChatRequest.from_openai([{"role": "user", "content": QUESTION}],
                                          greedy(64), tools=[WEATHER_TOOL])
        result = eng.submit(request).result(timeout=120)
    finally:
        eng.close()
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather",
                                                                   {"city": "Paris"})]
    assert json.loads(result.tool_calls[0].arguments_text) == {"city": "Paris"}
    assert result.finish_reason == FinishReason.TOOL_CALLS
    assert result.content == "" and not result.invalid_tool_calls
