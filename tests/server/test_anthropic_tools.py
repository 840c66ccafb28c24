"""Tools on the Messages door through the real ``anthropic`` SDK, on the tiny random-weight
model: forced calls (``tool``, ``any``) are valid ``tool_use`` blocks equal to the engine's
own calls, streamed as ``input_json_delta`` fragments that add up to the same input;
``disable_parallel_tool_use`` keeps one call; ``none`` hides the tools; a ``tool_result``
round trip answers as the engine does for the same OpenAI-shaped history."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from engine import ChatRequest, Completion, Engine, SamplingParams
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(120)
PICK: Any = {"name": "pick", "description": "Pick a colour.", "input_schema": {
    "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["colour"]}}
SHOUT: Any = {"name": "shout", "description": "Say a word loudly.", "input_schema": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
    "required": ["word"]}}
ASK: Any = [{"role": "user", "content": "Choose a colour."}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in (PICK, SHOUT)]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0,
                             timeout=60) as sdk:
        yield sdk


def engine_answer(eng: Engine, messages: list[dict[str, Any]], max_tokens: int,
                  **options: Any) -> Completion:
    return eng.submit(ChatRequest.from_openai(messages, SamplingParams(max_tokens=max_tokens),
                                              tools=OPENAI_TOOLS, **options)).result(timeout=60)


def calls_of(message: Any) -> list[Any]:
    return [block for block in message.content if block.type == "tool_use"]


def test_a_forced_tool_is_a_valid_tool_use_equal_to_the_engine_s_call(
        client: anthropic.Anthropic, server_engine: Engine) -> None:
    message = client.messages.create(model="tiny", max_tokens=80, messages=ASK,
                                     tools=[PICK, SHOUT], tool_choice={"type": "tool",
                                                                       "name": "pick"})
    assert message.stop_reason == "tool_use"
    [call] = calls_of(message)[:1]
    assert call.name == "pick" and call.input["colour"] in ("red", "blue")  # type: ignore[index]
    own = engine_answer(server_engine, ASK, 80, tool_choice="pick")
    assert [(b.name, b.input) for b in calls_of(message)] == [
        (c.name, c.arguments) for c in own.tool_calls]
    assert "".join(b.text for b in message.content if b.type == "text") == own.content


def test_any_tool_streamed_adds_up_to_the_whole_call(client: anthropic.Anthropic) -> None:
    ask: Any = {"model": "tiny", "max_tokens": 80, "messages": ASK, "tools": [PICK, SHOUT],
                "tool_choice": {"type": "any"}}
    whole = client.messages.create(**ask)
    assert whole.stop_reason == "tool_use" and calls_of(whole)
    events = list(client.messages.create(**ask, stream=True))
    starts = [e for e in events if e.type == "content_block_start"
              and e.content_block.type == "tool_use"]
    assert [(e.content_block.name, e.content_block.input) for e in starts] == [  # type: ignore[union-attr]
        (c.name, {}) for c in calls_of(whole)]
    for start, call in zip(starts, calls_of(whole)):
        fragments = [e.delta.partial_json for e in events  # type: ignore[union-attr]
                     if e.type == "content_block_delta" and e.index == start.index]  # type: ignore[union-attr]
        assert len(fragments) >= 1 and json.loads("".join(fragments)) == call.input
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in calls_of(final)] == [
        (b.name, b.input) for b in calls_of(whole)]
    assert final.stop_reason == "tool_use"


def test_disable_parallel_tool_use_keeps_one_call(client: anthropic.Anthropic,
                                                  server_engine: Engine) -> None:
    message = client.messages.create(
        model="tiny", max_tokens=120, messages=ASK, tools=[PICK, SHOUT],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(calls_of(message)) == 1
    own = engine_answer(server_engine, ASK, 120, tool_choice="required",
                        parallel_tool_calls=False)
    assert [(b.name, b.input) for b in calls_of(message)] == [
        (c.name, c.arguments) for c in own.tool_calls]


def test_tool_choice_none_answers_without_the_tools(client: anthropic.Anthropic,
                                                    server_engine: Engine) -> None:
    message = client.messages.create(model="tiny", max_tokens=10, messages=ASK,
                                     tools=[PICK], tool_choice={"type": "none"})
    own = server_engine.submit(ChatRequest.from_openai(ASK, SamplingParams(max_tokens=10))
                               ).result(timeout=60)
    assert not calls_of(message)
    assert "".join(b.text for b in message.content if b.type == "text") == own.content


def test_a_tool_result_round_trip_is_the_engine_s_own_answer(
        client: anthropic.Anthropic, server_engine: Engine) -> None:
    first = client.messages.create(model="tiny", max_tokens=80, messages=ASK,
                                   tools=[PICK, SHOUT], tool_choice={"type": "tool",
                                                                     "name": "pick"})
    call = calls_of(first)[0]
    history: Any = [*ASK, first.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id,
         "content": [{"type": "text", "text": "picked it"}]},
        {"type": "text", "text": "What now?"}]}]
    second = client.messages.create(model="tiny", max_tokens=12, messages=history,
                                    tools=[PICK, SHOUT])
    chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "pick", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "pick", "content": "picked it"},
        {"role": "user", "content": "What now?"}]
    own = engine_answer(server_engine, chat, 12)
    assert "".join(b.text for b in second.content if b.type == "text") == own.content
    assert [(b.name, b.input) for b in calls_of(second)] == [
        (c.name, c.arguments) for c in own.tool_calls]
    tokens = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert tokens == own.usage.prompt_tokens
    # An error result reads the same way (is_error has no place in a chat template).
    history[-1]["content"][0]["is_error"] = True
    assert client.messages.count_tokens(model="tiny", messages=history,
                                        tools=[PICK, SHOUT]).input_tokens == tokens


def test_an_image_in_a_tool_result_for_a_text_model_names_the_block(
        client: anthropic.Anthropic) -> None:
    history: Any = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "pick", "input": {"colour": "red"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "see"}, {
                                          "type": "image", "source": {
                                              "type": "base64", "media_type": "image/png",
                                              "data": "iVBORw0KGgo="}}]}]}]
    with pytest.raises(anthropic.BadRequestError,
                       match=r"messages\[2\]\.content\[0\]\.content\[1\]"):
        client.messages.create(model="tiny", max_tokens=4, messages=history, tools=[PICK])
