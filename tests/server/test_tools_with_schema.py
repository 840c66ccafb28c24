"""Tools and a response format in one request, through the openai SDK on loopback: the
reply is a tool call or JSON for the schema (one grammar, ``tool_choice`` auto), and a
forced choice beside a schema is a call. Chat completions and Responses."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}}
VERDICT = {"type": "object", "properties": {
    "sky": {"enum": ["clear", "cloudy"]}, "degrees": {"type": "integer", "maximum": 50}},
    "required": ["sky", "degrees"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
# Seeds whose sampled replies (temperature 2) on the tiny model take both branches of the
# union: greedy, this random model always opens the answer's "{".
SEEDS = range(12)


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def _ask(client: openai.OpenAI, seed: int | None, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=80, seed=seed, temperature=0.0 if seed is None else 2.0,
        tools=[WEATHER], response_format=FORMAT, parallel_tool_calls=False, **kw)  # type: ignore[arg-type]


def test_each_reply_is_a_call_or_the_schema_answer_and_both_occur(client: openai.OpenAI) -> None:
    kinds = set()
    for seed in SEEDS:
        choice = _ask(client, seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments),
                                WEATHER["function"]["parameters"])  # type: ignore[index]
            kinds.add("call")
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), VERDICT)
            kinds.add("answer")
    assert kinds == {"call", "answer"}


def test_a_forced_choice_beside_a_schema_is_a_call(client: openai.OpenAI) -> None:
    choice = _ask(client, None, tool_choice="required").choices[0]
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_responses_take_tools_and_a_text_format_together(client: openai.OpenAI,
                                                         tool_choice: str) -> None:
    # Responses has no seed: greedy only. Greedy, the tiny model answers (see SEEDS); a
    # forced choice makes it call. The call branch under "auto" is the chat test's.
    r = client.responses.create(
        model="tiny", input="Weather in Paris?", max_output_tokens=80, temperature=0.0,
        parallel_tool_calls=False, tool_choice=tool_choice,  # type: ignore[arg-type]
        tools=[{"type": "function", **WEATHER["function"]}],  # type: ignore[list-item, dict-item]
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}})
    [item] = r.output
    if tool_choice == "required":
        assert item.type == "function_call" and item.name == "get_weather"
    else:
        assert item.type == "message"
        jsonschema.validate(json.loads(r.output_text), VERDICT)


TIME = {"type": "function", "name": "get_time", "description": "Local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 8}},
                       "required": ["city"]}}
# A history whose get_weather call was answered (Responses input items).
ANSWERED: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees."}]


def _respond(client: openai.OpenAI, tools: list[Any], limit: int) -> Any:
    return client.responses.create(
        model="tiny", input=ANSWERED, max_output_tokens=80, temperature=0.0,
        parallel_tool_calls=False, tool_choice="required", tools=tools,
        extra_body={"tool_call_limit": limit})


def test_responses_tool_call_limit_sends_a_required_call_to_another_tool(
        client: openai.OpenAI) -> None:
    weather = {"type": "function", **WEATHER["function"]}
    [item] = _respond(client, [weather, TIME], 1).output
    assert item.type == "function_call" and item.name == "get_time"
    [again] = _respond(client, [weather], 2).output  # below its limit: still offered
    assert again.type == "function_call" and again.name == "get_weather"


def test_a_required_call_with_every_tool_at_its_limit_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_call_limit") as refused:
        _respond(client, [{"type": "function", **WEATHER["function"]}], 1)
    assert refused.value.body["param"] == "tool_call_limit"  # type: ignore[index]
