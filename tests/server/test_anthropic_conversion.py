"""The Messages door's conversion, on a scripted engine (no model): what an Anthropic
request becomes in the engine's ``ChatRequest``, refusals naming the field the client sent
in Anthropic's error envelope, and the events the translator makes of engine events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import (
    Completion,
    FinishReason,
    InvalidToolCall,
    JsonSchema,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from mlx_providers.server import ServerSettings, create_app
from mlx_providers.server.anthropic_events import MessageTranslator, matched_stop
from tests.fake_engine import Reply, ScriptedEngine

pytestmark = pytest.mark.timeout(60)

PICK = {"name": "pick", "description": "Pick a colour.", "input_schema": {
    "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
    "required": ["colour"]}}
PNG_B64 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
           "RU5ErkJggg==")


@pytest.fixture
def fake() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def client(fake: ScriptedEngine) -> Iterator[TestClient]:
    with TestClient(create_app({"m": fake})) as test_client:  # type: ignore[dict-item]
        yield test_client


def post(client: TestClient, path: str = "/v1/messages", **body: Any) -> Any:
    return client.post(path, json={"model": "m", "max_tokens": 16, **body})


def refusal(response: Any, status: int = 400) -> str:
    """The message of an Anthropic error envelope (asserting the envelope's shape)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    kinds = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 413: "request_too_large", 529: "overloaded_error"}
    assert body["error"]["type"] == kinds[status]
    return str(body["error"]["message"])


def test_a_conversation_of_blocks_becomes_the_rulebook_s_messages(
        client: TestClient, fake: ScriptedEngine) -> None:
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    reply = post(client, system=system, tools=[PICK], messages=[
                     {"role": "user", "content": "Choose."},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "Red or blue?", "signature": "sig"},
                         {"type": "redacted_thinking", "data": "opaque"},
                         {"type": "text", "text": "Let me pick."},
                         {"type": "tool_use", "id": "toolu_1", "name": "pick",
                          "input": {"colour": "red"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1",
                          "content": [{"type": "text", "text": "picked red"}]},
                         {"type": "text", "text": "Thanks. "},
                         {"type": "text", "text": "Again?", "cache_control": {
                             "type": "ephemeral"}}]}],
                 metadata={"user_id": "u1"}, service_tier="auto")
    assert reply.status_code == 200, reply.text
    sent = [m.as_openai() for m in fake.calls[-1].prompt.messages]  # type: ignore[union-attr]
    assert sent == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Choose."},
        {"role": "assistant", "content": "Let me pick.", "reasoning_content": "Red or blue?",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "pick", "arguments": {"colour": "red"}}}]},
        {"role": "tool", "content": "picked red", "name": "pick", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Thanks. Again?"}]


@pytest.mark.parametrize(("choice", "engine_choice", "parallel"), [
    (None, "auto", True), ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True), ({"type": "tool", "name": "pick"}, "pick", True),
    ({"type": "none"}, "none", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False)])
def test_tool_choice_maps_to_the_engine_s(client: TestClient, fake: ScriptedEngine,
                                          choice: Any, engine_choice: str,
                                          parallel: bool) -> None:
    body: dict[str, Any] = {"tools": [PICK], "messages": [{"role": "user", "content": "hi"}]}
    if choice is not None:
        body["tool_choice"] = choice
    assert post(client, **body).status_code == 200
    call = fake.calls[-1]
    assert (call.tool_choice, call.parallel_tool_calls) == (engine_choice, parallel)
    assert call.tools == [{"type": "function", "function": {
        "name": "pick", "description": "Pick a colour.", "parameters": PICK["input_schema"]}}]


def test_sampling_thinking_and_format_reach_the_engine(client: TestClient,
                                                       fake: ScriptedEngine) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = post(client, messages=[{"role": "user", "content": "hi"}], max_tokens=9,
                 temperature=0.4, top_p=0.8, top_k=7, stop_sequences=["END", "STOP"],
                 thinking={"type": "enabled", "budget_tokens": 5},
                 output_config={"effort": "max",
                                "format": {"type": "json_schema", "schema": schema}})
    assert reply.status_code == 200, reply.text
    call = fake.calls[-1]
    params = call.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (
        9, 0.4, 0.8, 7)
    assert params.stop == ("END", "STOP") and params.reasoning_budget == 5
    assert isinstance(params.constraint, JsonSchema)
    assert call.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    post(client, messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": False}
    assert fake.calls[-1].params.temperature == 0.0  # the server's default: greedy
    post(client, messages=[{"role": "user", "content": "hi"}], thinking={"type": "adaptive"})
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": True}
    assert fake.calls[-1].params.reasoning_budget is None


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "ok"}, {"type": "document", "source": {}}]}]}]},
     "messages[0].content[0].content[1].type"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "pick",
                                        "input": "not json"}]}]},
     "messages[1].content[1].input"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "@@@"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "pick", "input_schema": {"type": "string"}}]},
     "tools[0].input_schema.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [PICK],
      "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
     "thinking"),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_budget": 3,
      "thinking": {"type": "enabled", "budget_tokens": 4}}, "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "hi"}], "output_config": {
        "format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}, "keep_alive"),
    ({"messages": [{"role": "user", "content": "hi"}], "adapter": "nope"}, "adapter"),
])
def test_refusals_name_the_field_the_client_sent(client: TestClient, body: dict[str, Any],
                                                 field: str) -> None:
    assert field in refusal(post(client, **body))


def test_max_tokens_is_required(client: TestClient) -> None:
    reply = client.post("/v1/messages", json={"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})
    assert "max_tokens" in refusal(reply)


def test_other_errors_in_anthropic_s_envelope(client: TestClient) -> None:
    assert "'nope'" in refusal(post(client, model="nope", messages=[
        {"role": "user", "content": "hi"}]), 404)
    assert "count_tokens" in refusal(client.get("/v1/messages/batches"), 404)
    not_json = client.post("/v1/messages", content=b"{", headers={
        "content-type": "application/json"})
    assert "JSON" in refusal(not_json)


def test_a_body_over_the_limit_is_request_too_large(fake: ScriptedEngine) -> None:
    app = create_app({"m": fake}, settings=ServerSettings(max_body_bytes=1000))  # type: ignore[dict-item]
    with TestClient(app) as small:
        reply = post(small, messages=[{"role": "user", "content": "x" * 2000}])
    refusal(reply, 413)


def test_count_tokens_counts_the_request_as_the_engine_does(
        client: TestClient, fake: ScriptedEngine) -> None:
    reply = client.post("/v1/messages/count_tokens", json={
        "model": "m", "system": "Be brief.", "messages": [
            {"role": "user", "content": "one two three"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"input_tokens": (2 + 3) + (3 + 3)}  # the scripted count
    assert not fake.calls  # nothing was generated
    assert "messages[0].role" in refusal(client.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "robot", "content": "hi"}]}))


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of an SSE body, asserting each data's type is its event's."""
    out = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if "event" not in lines:
            continue  # a comment (sse-starlette's keep-alive)
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


CALL = ToolCall("call_1", "pick", {"colour": "red"}, '{"colour": "red"}')


def test_a_streamed_call_and_its_whole_message_agree() -> None:
    fake = ScriptedEngine(Reply(pieces=("Let me see.",), finish_reason=FinishReason.TOOL_CALLS,
                                tool_calls=(CALL,)))
    with TestClient(create_app({"m": fake})) as client:  # type: ignore[dict-item]
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [PICK]}
        whole = post(client, **body).json()
        streamed = _events(post(client, **body, stream=True).text)
    assert whole["content"] == [
        {"type": "text", "text": "Let me see."},
        {"type": "tool_use", "id": "call_1", "name": "pick", "input": {"colour": "red"}}]
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0, "output_tokens": 1,
                              "output_tokens_details": {"thinking_tokens": 0}}
    assert [name for name, _ in streamed] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    start = streamed[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 4  # counted while the row ran ("hi" + 3)
    assert streamed[5][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "call_1", "name": "pick", "input": {}}}
    assert streamed[6][1]["delta"] == {"type": "input_json_delta",
                                       "partial_json": '{"colour": "red"}'}
    delta = streamed[8][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == whole["usage"]


def test_a_call_cut_by_max_tokens_is_streamed_but_not_in_the_whole_message() -> None:
    translator = MessageTranslator("m")
    events = translator.start()
    events += translator.feed(StreamEvent("", tool_call_deltas=(
        ToolCallDelta(0, "call_1", "pick"), ToolCallDelta(0, arguments='{"colour": "red"}'))))
    events += translator.feed(StreamEvent("", tool_call_deltas=(
        ToolCallDelta(1, "call_2", "pick"), ToolCallDelta(1, arguments='{"col'))))
    usage = Usage(prompt_tokens=5, completion_tokens=9)
    completion = Completion("", (), FinishReason.LENGTH, usage, tool_calls=(CALL,),
                            invalid_tool_calls=(InvalidToolCall("call_2", "pick", '{"col',
                                                                "cut", index=1),))
    events += translator.feed(StreamEvent("", finish_reason=FinishReason.LENGTH, usage=usage,
                                          completion=completion))
    started = [e["content_block"]["id"] for e in events if e["type"] == "content_block_start"]
    assert started == ["call_1", "call_2"]  # both went out as they were written
    message = translator.message()
    assert [b["id"] for b in message["content"]] == ["call_1"]
    assert message["content"][0]["input"] == {"colour": "red"}
    assert message["stop_reason"] == "max_tokens"


def test_a_failure_mid_stream_is_an_error_event() -> None:
    fake = ScriptedEngine(Reply(pieces=("a",), error=RuntimeError("device lost")))
    with TestClient(create_app({"m": fake})) as client:  # type: ignore[dict-item]
        events = _events(post(client, messages=[{"role": "user", "content": "hi"}],
                              stream=True).text)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "device lost" in events[-1][1]["error"]["message"]


def test_the_stop_sequence_found_first_is_the_one_reported() -> None:
    assert matched_stop("abc END def STOP", ["STOP", "END"]) == "END"
    assert matched_stop("abc", ["STOP"]) is None
