"""Strict schemas in the engine: a random-weight model writes junk, and the grammar lets
it write only declared keys, at every level, in structured output and forced tool calls.

Every string is bounded and every number an enum, so each output is finite and completes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine import ChatRequest, Engine, FinishReason, SamplingParams, TextRequest
from engine.requests.constraints.schemas import strict_schema
from engine.requests.inbound.output_constraint import JsonSchema
from tests.conftest import greedy

# Nothing required below the top: the model chooses which declared keys to write.
STAY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "stay": {"type": "object", "properties": {
            "nights": {"enum": [1, 2, 3]},
            "room": {"type": "object", "properties": {
                "kind": {"enum": ["single", "double"]}, "view": {"type": "boolean"}}},
        }},
        "guests": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6}, "age": {"enum": [20, 30]}}}},
    },
    "required": ["city", "stay"],
}


class Room(BaseModel):
    kind: Literal["single", "double"]
    floor: Literal[1, 2] | None = None


class Booking(BaseModel):
    hotel: str = Field(max_length=8)
    room: Room
    extras: list[Room] = Field(default=[], max_length=2)


def sampled(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=400, temperature=1.0, seed=seed, **kw)


def assert_only_declared_keys(value: Any, schema: dict[str, Any]) -> None:
    """Valid as the user wrote it, and with every object level closed."""
    jsonschema.validate(value, schema)
    errors = [e.message for e in jsonschema.Draft202012Validator(
        strict_schema(schema)).iter_errors(value)]
    assert not errors, (errors, keys_by_level(value))


def keys_by_level(value: Any, path: str = "$") -> dict[str, set[str]]:
    """Every object's keys, by where it sits, for the failure message."""
    found: dict[str, set[str]] = {}
    if isinstance(value, dict):
        found[path] = set(value)
        for key, item in value.items():
            found.update(keys_by_level(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.update(keys_by_level(item, f"{path}[{index}]"))
    return found


@pytest.mark.parametrize("schema", [STAY, Booking.model_json_schema()], ids=["hand", "pydantic"])
def test_structured_output_has_only_declared_keys_at_every_level(
        tiny_engine: Engine, schema: dict[str, Any]) -> None:
    constraint = JsonSchema(schema)  # the user's schema: the engine makes it strict
    handles = [tiny_engine.submit(TextRequest(f"book {i}", greedy(400, constraint=constraint)))
               for i in range(3)]
    handles += [tiny_engine.submit(TextRequest("book a room", sampled(seed, constraint=constraint)))
                for seed in range(5)]
    for handle in handles:
        result = handle.result(timeout=120)
        assert result.finish_reason is FinishReason.STOP, result.text
        assert_only_declared_keys(json.loads(result.text), schema)


NESTED_TOOL = {"type": "function", "function": {
    "name": "book", "description": "Book a room.", "parameters": STAY}}
PYDANTIC_TOOL = {"type": "function", "function": {
    "name": "reserve", "description": "Reserve a room.",
    "parameters": Booking.model_json_schema()}}  # $defs + $ref under the call's arguments
ASK = [{"role": "user", "content": "Book me a room in Paris."}]


@pytest.mark.parametrize("tool", [NESTED_TOOL, PYDANTIC_TOOL], ids=["hand", "pydantic"])
def test_forced_call_arguments_have_only_declared_keys(tiny_engine: Engine,
                                                       tool: dict[str, Any]) -> None:
    name = tool["function"]["name"]
    parameters = tool["function"]["parameters"]
    def forced(messages: list[dict[str, str]], params: SamplingParams) -> ChatRequest:
        return ChatRequest.from_openai(messages, params, tools=[tool], tool_choice=name,
                                       parallel_tool_calls=False)

    handles = [tiny_engine.submit(forced([{"role": "user",
                                           "content": f"{ASK[0]['content']} #{i}"}],
                                         greedy(400)))
               for i in range(2)]
    handles += [tiny_engine.submit(forced(ASK, sampled(seed))) for seed in range(4)]
    for handle in handles:
        result = handle.result(timeout=120)
        assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
        assert not result.invalid_tool_calls, result.invalid_tool_calls
        assert [call.name for call in result.tool_calls] == [name]
        assert_only_declared_keys(result.tool_calls[0].arguments, parameters)


def test_required_choice_among_tools_with_nested_arguments(tiny_engine: Engine) -> None:
    tools = [NESTED_TOOL, PYDANTIC_TOOL]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(4):
        request = ChatRequest.from_openai(ASK, sampled(seed), tools=tools,
                                          tool_choice="required", parallel_tool_calls=False)
        result = tiny_engine.submit(request).result(timeout=120)
        assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
        call = result.tool_calls[0]
        assert_only_declared_keys(call.arguments, by_name[call.name])
