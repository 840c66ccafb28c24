"""The engine's typed request: ``Engine.submit`` takes one request value as it is (a
``ChatRequest`` built from typed parts or from OpenAI shapes is the same request), and the
completion says what max_tokens cut."""

from __future__ import annotations

import pytest

from engine import (
    ChatRequest,
    Engine,
    JsonSchema,
    SamplingParams,
    messages_from_openai,
    normalize_tools,
)
from engine.requests.outbound.results import FORCED_CALL, STRUCTURED_JSON
from tests.conftest import greedy

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}}}
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def test_a_chat_request_from_typed_parts_is_one_from_openai_shapes(tiny_engine: Engine) -> None:
    params = greedy(8)
    from_wire = ChatRequest.from_openai(ASK, params, tools=[WEATHER], tool_choice="auto")
    typed = ChatRequest(messages_from_openai(ASK), params, normalize_tools([WEATHER]), "auto")
    by_wire = tiny_engine.submit(from_wire).result(timeout=60)
    by_parts = tiny_engine.submit(typed).result(timeout=60)
    assert by_wire.token_ids == by_parts.token_ids
    assert by_wire.usage.prompt_tokens == by_parts.usage.prompt_tokens


def test_submit_takes_one_request_value(tiny_engine: Engine) -> None:
    typed = ChatRequest.from_openai(ASK)
    with pytest.raises(TypeError, match="positional"):
        tiny_engine.submit(typed, SamplingParams())  # type: ignore[misc]
    with pytest.raises(TypeError, match="tools"):
        tiny_engine.submit(typed, tools=[WEATHER])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"ChatRequest\.from_openai"):
        tiny_engine.submit(ASK)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TextRequest\(prompt, params\)"):
        tiny_engine.submit("hello")  # type: ignore[arg-type]


def test_the_completion_says_when_max_tokens_cut_a_forced_call(tiny_engine: Engine) -> None:
    forced = ChatRequest.from_openai(ASK, greedy(2), tools=[WEATHER], tool_choice="get_weather")
    cut = tiny_engine.submit(forced).result(timeout=60)
    assert cut.truncated == FORCED_CALL
    error = cut.truncation_error()
    assert error is not None and "max_tokens=2" in str(error)
    free = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(2))).result(timeout=60)
    assert free.truncated is None and free.truncation_error() is None  # text may be cut


def test_the_completion_says_when_max_tokens_cut_strict_json(tiny_engine: Engine) -> None:
    schema = JsonSchema({"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]})
    request = ChatRequest.from_openai(ASK, greedy(2, constraint=schema))
    cut = tiny_engine.submit(request).result(timeout=60)
    assert cut.truncated == STRUCTURED_JSON
