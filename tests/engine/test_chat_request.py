"""The engine's typed request: ``Engine.submit`` takes a ``ChatRequest`` as it is, raw
arguments are converted into the same value, and the completion says what max_tokens cut."""

from __future__ import annotations

import pytest

from engine import ChatRequest, Engine, JsonSchema, SamplingParams
from engine.requests.outbound.results import FORCED_CALL, STRUCTURED_JSON
from tests.conftest import greedy

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}}}
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def test_a_chat_request_is_what_raw_arguments_become(tiny_engine: Engine) -> None:
    params = greedy(8)
    typed = ChatRequest.from_openai(ASK, params, tools=[WEATHER], tool_choice="auto")
    by_value = tiny_engine.submit(typed).result(timeout=60)
    by_arguments = tiny_engine.submit(ASK, params, tools=[WEATHER],
                                      tool_choice="auto").result(timeout=60)
    assert by_value.token_ids == by_arguments.token_ids
    assert by_value.usage.prompt_tokens == by_arguments.usage.prompt_tokens


def test_a_chat_request_carries_its_own_options(tiny_engine: Engine) -> None:
    typed = ChatRequest.from_openai(ASK)
    with pytest.raises(TypeError, match="carries its own"):
        tiny_engine.submit(typed, SamplingParams())
    with pytest.raises(TypeError, match="carries its own"):
        tiny_engine.submit(typed, tools=[WEATHER])


def test_the_completion_says_when_max_tokens_cut_a_forced_call(tiny_engine: Engine) -> None:
    cut = tiny_engine.submit(ASK, greedy(2), tools=[WEATHER],
                             tool_choice="get_weather").result(timeout=60)
    assert cut.truncated == FORCED_CALL
    error = cut.truncation_error()
    assert error is not None and "max_tokens=2" in str(error)
    free = tiny_engine.submit(ASK, greedy(2)).result(timeout=60)
    assert free.truncated is None and free.truncation_error() is None  # text may be cut


def test_the_completion_says_when_max_tokens_cut_strict_json(tiny_engine: Engine) -> None:
    schema = JsonSchema({"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]})
    cut = tiny_engine.submit(ASK, greedy(2, constraint=schema)).result(timeout=60)
    assert cut.truncated == STRUCTURED_JSON
