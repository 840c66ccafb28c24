"""A fitted family model writes its own call unforced, and the engine reads it back.

For each family the catalog marks ``fitted`` (at least one per dialect), the tiny model is
fitted for seconds on one transcript: the engine's own prompt for a question with a
``get_weather`` tool, then the call as the family writes it unforced (after a thought where
the prompt opened reasoning) and its end of turn. Through the Engine, a chat request with
that tool (``tool_choice`` auto) then comes back as exactly that text, the call parsed,
finish_reason tool_calls, no markup left in the content and the thought in reasoning.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import ChatRequest, Engine, EngineConfig, FinishReason
from engine.requests.outbound.channels import REASONING
from engine.requests.prepare import Preparer
from testkit.families import FAMILIES
from testkit.families.fitting import Transcript, fit_to_transcripts
from testkit.families.transcripts import QUESTION, WEATHER_TOOL
from tests.conftest import greedy

THOUGHT = "I should look it up."


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.expected.fitted))
def test_a_fitted_models_own_call_is_parsed_with_no_markup_left(
        name: str, family_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    family = FAMILIES[name]
    expected = family.expected
    fitted = Path(shutil.copytree(family_model_dir(name), tmp_path / name))
    request = ChatRequest.from_openai([{"role": "user", "content": QUESTION}], greedy(80),
                                      tools=[WEATHER_TOOL])
    eng = Engine(fitted, EngineConfig()).start()
    try:  # the prompt exactly as the engine renders it, tools and all
        prepared = Preparer(eng.tokenizer, fitted, family.vocab_size).prepare(request)
        opened = prepared.start_channel == REASONING
        reasoning = expected.reasoning
        written = expected.call_written
        if opened:  # the prompt opened reasoning: the model closes it before its call
            assert reasoning is not None, f"{name}'s prompt opened reasoning it has no syntax for"
            written = reasoning.turn(THOUGHT, written, opened=True)
        completion = eng.tokenizer.encode(written + expected.call_ends_with,
                                          add_special_tokens=False)
    finally:
        eng.close()
    fit_to_transcripts(fitted, [Transcript(prepared.prompt_ids, completion)])
    eng = Engine(fitted, EngineConfig()).start()
    try:
        result = eng.submit(request).result(timeout=120)
    finally:
        eng.close()
    # Whole, gpt-oss's " to=functions..." with the space that starts its output included.
    assert result.text == written
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather",
                                                                   {"city": "Paris"})]
    assert json.loads(result.tool_calls[0].arguments_text) == {"city": "Paris"}
    assert result.finish_reason == FinishReason.TOOL_CALLS and not result.invalid_tool_calls
    assert result.content == ""
    if opened:
        assert (result.reasoning or "").strip() == THOUGHT
