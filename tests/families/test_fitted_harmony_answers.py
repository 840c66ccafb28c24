"""gpt-oss answers under a constraint, on its real tokenizer and template, through the Engine.

The tiny gpt-oss model is fitted for seconds to two turns as gpt-oss writes them: for the
question alone, an analysis message then the answer JSON on the final channel; for the
question with a ``get_weather`` tool, an analysis message then the call. Then a request
with a JSON schema (response_format) comes back with the JSON in content and, under a
reasoning budget, the analysis in reasoning; with tools beside the schema, a parsed call
(or the schema's JSON); a forced call after a bounded analysis; budget 0 and no budget
leave no analysis.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine import ChatRequest, Engine, EngineConfig, FinishReason, JsonSchema
from engine.requests.prepare import Preparer
from testkit.families import FAMILIES
from testkit.families.fitting import Transcript, fit_to_transcripts
from tests.conftest import greedy

VERDICT = {"type": "object", "properties": {"answer": {"enum": ["sunny", "rainy"]}},
           "required": ["answer"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user asks about Paris."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
ANSWER = ANALYSIS + '<|channel|>final<|message|>{"answer": "sunny"}<|return|>'
CALL = ANALYSIS + ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                   '<|message|>{"city": "Paris"}<|call|>')


def _request(budget: int | None = None, *, schema: bool = True, tools: bool = False,
             choice: str = "auto") -> ChatRequest:
    params = greedy(64, reasoning_budget=budget,
                    constraint=JsonSchema(VERDICT) if schema else None)
    return ChatRequest.from_openai(ASK, params, tools=[WEATHER] if tools else None,
                                   tool_choice=choice)


@pytest.fixture(scope="module")
def engine(family_model_dir: Callable[[str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    fitted = Path(shutil.copytree(family_model_dir("gpt_oss"),
                                  tmp_path_factory.mktemp("harmony") / "gpt_oss"))
    eng = Engine(fitted, EngineConfig()).start()
    try:
        preparer = Preparer(eng.tokenizer, fitted, FAMILIES["gpt_oss"].vocab_size)
        encode = eng.tokenizer.encode
        transcripts = [Transcript(preparer.prepare(_request(tools=tools)).prompt_ids,
                                  encode(completion, add_special_tokens=False))
                       for tools, completion in ((False, ANSWER), (True, CALL))]
    finally:
        eng.close()
    fit_to_transcripts(fitted, transcripts)
    eng = Engine(fitted, EngineConfig(max_batch=4)).start()
    yield eng
    eng.close()


def _answer(result: Any) -> None:
    jsonschema.validate(json.loads(result.content), VERDICT)
    assert result.finish_reason == FinishReason.STOP and not result.tool_calls


def test_a_json_answer_comes_back_in_content_and_the_analysis_in_reasoning(
        engine: Engine) -> None:
    result = engine.submit(_request(16)).result(timeout=120)
    assert result.reasoning == THOUGHT
    _answer(result)
    assert json.loads(result.content) == {"answer": "sunny"}


@pytest.mark.parametrize("budget", [None, 0])
def test_without_a_budget_the_answer_comes_without_analysis(engine: Engine,
                                                           budget: int | None) -> None:
    result = engine.submit(_request(budget)).result(timeout=120)
    assert not result.reasoning
    _answer(result)


def test_the_budget_cuts_the_analysis_at_n_tokens(engine: Engine) -> None:
    result = engine.submit(_request(3)).result(timeout=120)
    reasoning_ids = engine.tokenizer.encode(result.reasoning or "", add_special_tokens=False)
    assert 0 < len(reasoning_ids) <= 3 and THOUGHT.startswith(result.reasoning)
    _answer(result)


def test_tools_beside_a_schema_give_a_call_or_the_schema_s_json(engine: Engine) -> None:
    result = engine.submit(_request(16, tools=True)).result(timeout=120)
    assert result.reasoning == THOUGHT
    if result.tool_calls:
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather",
                                                                       {"city": "Paris"})]
        assert result.finish_reason == FinishReason.TOOL_CALLS and result.content == ""
    else:
        _answer(result)


def test_tools_beside_a_schema_without_a_budget(engine: Engine) -> None:
    result = engine.submit(_request(tools=True)).result(timeout=120)
    assert not result.reasoning
    if result.tool_calls:
        assert [c.name for c in result.tool_calls] == ["get_weather"]
        assert result.content == ""
    else:
        _answer(result)


def test_a_forced_call_after_a_bounded_analysis(engine: Engine) -> None:
    result = engine.submit(_request(16, schema=False, tools=True,
                                    choice="required")).result(timeout=120)
    assert result.reasoning == THOUGHT
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather",
                                                                   {"city": "Paris"})]
    assert result.finish_reason == FinishReason.TOOL_CALLS and result.content == ""
