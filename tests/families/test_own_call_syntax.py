"""Llama 3.x, Mistral Small 3.2 / Ministral 3, DeepSeek-R1, Phi-3.5, Qwen3, Granite 4 and
SmolLM3 on their real tokenizers and templates: each speaks its own tool-call dialect.

For each family: the dialect its tokenizer picks; a grammar-forced call (any tool with
parallel calls on and off, a named tool) through the Engine on the tiny family model is
written in the family's own syntax and comes back as a parsed call with arguments valid
for the schema and no markup in content; where the prompt opens a thinking block, the
forced call closes it first; and a second turn, the tool result in the history under
another provider's call id, renders through the real template with the result in it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, EngineConfig, FinishReason
from engine.requests.prepare import Preparer
from testkit.families.fitting import Transcript, fit_to_transcripts
from tests.conftest import greedy

_DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
# family -> (its dialect's name, text every forced call of it starts with): DeepSeek-R1's
# prompt opens the thinking block, so its forced call closes it first.
DIALECTS: dict[str, tuple[str, str]] = {
    "llama3_1": ("llama3-json", '{"name": "'),
    "llama3_2": ("llama3-json", '{"name": "'),
    "mistral_small_3_2": ("mistral", "[TOOL_CALLS]"),
    "ministral3_reasoning": ("mistral", "[TOOL_CALLS]"),
    "deepseek_r1_qwen": ("deepseek-r1", "</think>\n\n" + _DS_CALLS),
    "phi3_5": ("tagged-json", "<tool_call>"),
    "qwen3": ("tagged-json", "<tool_call>"),
    "granite4": ("tagged-json", "<tool_call>"),
    "smollm3": ("tagged-json", "<tool_call>"),
}
CITIES = ["Paris", "Oslo", "Lima"]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "enum": CITIES}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "enum": CITIES}},
                       "required": ["city"]}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FOREIGN_ID = "call_0123456789abcdefghijklmn"  # another provider's id: not 9 alphanumerics
RESULT = "22 degrees and sunny"
SECOND_TURN = [*QUESTION,
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": FOREIGN_ID, "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": FOREIGN_ID, "content": RESULT}]


@pytest.fixture(scope="module", params=sorted(DIALECTS))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(name: str, family_model_dir: Callable[[str], Path]) -> Iterator[Engine]:
    eng = Engine(family_model_dir(name), EngineConfig(max_batch=4)).start()
    yield eng
    eng.close()


def preparer(eng: Engine) -> Preparer:
    """The engine's request preparation, as its thread builds it (the prompt it renders)."""
    return Preparer(eng.tokenizer, eng.model_path, len(eng.tokenizer.vocab))


def test_the_family_speaks_its_own_dialect(name: str, engine: Engine) -> None:
    assert preparer(engine).dialect.name == DIALECTS[name][0]


@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False),
                                                  ("get_time", True)])
def test_a_forced_call_is_written_in_the_familys_syntax_and_parsed(
        name: str, engine: Engine, choice: str, parallel: bool) -> None:
    tool_choice: Any = (choice if choice == "required"
                        else {"type": "function", "function": {"name": choice}})
    request = ChatRequest.from_openai(QUESTION, greedy(160), tools=TOOLS,
                                      tool_choice=tool_choice, parallel_tool_calls=parallel)
    result = engine.submit(request).result(timeout=120)
    assert result.text.lstrip().startswith(DIALECTS[name][1]), result.text
    assert result.finish_reason == FinishReason.TOOL_CALLS, (result.text, result.invalid_tool_calls)
    assert result.tool_calls and not result.invalid_tool_calls
    assert result.content == "" and not result.reasoning
    for call in result.tool_calls:
        assert call.name in (("get_weather", "get_time") if choice == "required" else (choice,))
        assert call.arguments.keys() == {"city"} and call.arguments["city"] in CITIES
    if not parallel:
        assert len(result.tool_calls) == 1


def test_the_second_turn_renders_the_tool_result(name: str, engine: Engine) -> None:
    request = ChatRequest.from_openai(SECOND_TURN, greedy(4), tools=TOOLS)
    prompt = engine.tokenizer.decode(preparer(engine).prepare(request).prompt_ids)
    assert RESULT in prompt
    assert engine.submit(request).result(timeout=120).token_ids


# family -> the call its model writes unforced, as its template renders one, and its end
# of turn (a stop token): the fitted model must have it parsed, nothing left in content.
_TAGGED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NATIVE: dict[str, tuple[str, str]] = {
    "qwen3": (_TAGGED, "<|im_end|>"),
    "granite4": (_TAGGED, "<|end_of_text|>"),
    "llama3_1": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|eot_id|>"),
    "mistral_small_3_2": ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
                          "</s>"),
    "deepseek_r1_qwen": ("I should look it up.\n</think>\n\n"
                         f"{_DS_CALLS}<\uff5ctool\u2581call\u2581begin\uff5c>function"
                         "<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n"
                         '{"city": "Paris"}\n```<\uff5ctool\u2581call\u2581end\uff5c>'
                         "<\uff5ctool\u2581calls\u2581end\uff5c>",
                         "<\uff5cend\u2581of\u2581sentence\uff5c>"),
}


@pytest.mark.fitted
@pytest.mark.parametrize("family", sorted(NATIVE))
def test_a_fitted_models_own_call_is_parsed_with_no_markup_left(
        family: str, family_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    written, end_of_turn = NATIVE[family]
    fitted = Path(shutil.copytree(family_model_dir(family), tmp_path / family))
    request = ChatRequest.from_openai(QUESTION, greedy(80), tools=TOOLS[:1])
    eng = Engine(fitted, EngineConfig()).start()
    try:  # the prompt exactly as the engine renders it, tools and all
        prompt = preparer(eng).prepare(request).prompt_ids
        completion = eng.tokenizer.encode(written + end_of_turn, add_special_tokens=False)
    finally:
        eng.close()
    fit_to_transcripts(fitted, [Transcript(prompt, completion)])
    eng = Engine(fitted, EngineConfig()).start()
    try:
        result = eng.submit(request).result(timeout=120)
    finally:
        eng.close()
    assert result.text == written
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather",
                                                                   {"city": "Paris"})]
    assert result.finish_reason == FinishReason.TOOL_CALLS and not result.invalid_tool_calls
    assert result.content == ""
    if family == "deepseek_r1_qwen":
        assert result.reasoning == "I should look it up.\n"
