"""Anthropic's Messages API through the real ``anthropic`` SDK over loopback, on the tiny
random-weight model: each answer is the engine's own for the same request (greedy), whole,
streamed and from the async client; stop reasons, usage with the prefix cache's share,
count_tokens, structured output, extra options, errors in Anthropic's envelope and the
SDK's exception classes, the API key as either header, load shed as 529, and a dropped
connection evicting its row."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import anthropic
import httpx
import pytest
from pydantic import BaseModel

from engine import ChatRequest, Completion, Engine, FinishReason, SamplingParams
from mlx_providers.server import ServerSettings
from tests.conftest import wait_until
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(120)
Serve = Callable[..., tuple[LiveServer, Engine]]
SYSTEM = "You are terse."
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0,
                             timeout=60) as sdk:
        yield sdk


def engine_answer(eng: Engine, messages: list[dict[str, Any]], max_tokens: int,
                  **params: Any) -> Completion:
    """The engine's own answer for OpenAI-shaped messages (what the door must equal)."""
    return eng.submit(ChatRequest.from_openai(messages, SamplingParams(
        max_tokens=max_tokens, **params))).result(timeout=60)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def assert_same(message: Any, completion: Completion) -> None:
    """A Messages answer equals the engine's completion: text, stop reason, token counts."""
    assert text_of(message) == completion.content
    expected = {FinishReason.LENGTH: "max_tokens", FinishReason.STOP: "end_turn"}
    assert message.stop_reason == expected[completion.finish_reason]
    usage = message.usage
    assert usage.output_tokens == completion.usage.completion_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == completion.usage.prompt_tokens


def test_a_message_is_the_engine_s_own_answer(client: anthropic.Anthropic,
                                              server_engine: Engine) -> None:
    message = client.messages.create(model="tiny", max_tokens=12, system=SYSTEM,
                                     messages=HI)  # type: ignore[arg-type]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tiny"
    assert [block.type for block in message.content] == ["text"]
    assert_same(message, engine_answer(server_engine, [
        {"role": "system", "content": SYSTEM}, *HI], 12))


def test_system_blocks_multi_turn_and_a_system_message_read_as_chat_messages(
        client: anthropic.Anthropic, server_engine: Engine) -> None:
    turns: list[Any] = [{"role": "user", "content": "My name is Ada."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Hi Ada."}]},
                        {"role": "user", "content": [{"type": "text", "text": "My name?"}]}]
    message = client.messages.create(
        model="tiny", max_tokens=10, messages=turns,
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}])
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Hi Ada."}, {"role": "user", "content": "My name?"}]
    assert_same(message, engine_answer(server_engine, chat, 10))
    # The SDK's types also allow a system message among the messages.
    inline = client.messages.create(model="tiny", max_tokens=10, messages=[
        {"role": "system", "content": SYSTEM}, *turns])  # type: ignore[list-item]
    assert text_of(inline) == text_of(message)


async def test_the_async_client_and_a_stream_give_the_whole_answer(
        live_server: LiveServer, client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=12, messages=HI)  # type: ignore[arg-type]
    async with anthropic.AsyncAnthropic(base_url=live_server.url, api_key="unused",
                                        max_retries=0, timeout=60) as sdk:
        answered = await sdk.messages.create(model="tiny", max_tokens=12, messages=HI)  # type: ignore[arg-type]
        async with sdk.messages.stream(model="tiny", max_tokens=12, messages=HI) as stream:  # type: ignore[arg-type]
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
    with client.messages.stream(model="tiny", max_tokens=12, messages=HI) as sync_stream:  # type: ignore[arg-type]
        sync_pieces = list(sync_stream.text_stream)
        sync_final = sync_stream.get_final_message()
    for other in (answered, final, sync_final):  # (a stream's blocks are Parsed… types)
        assert [b.type for b in other.content] == ["text"] and text_of(other) == text_of(whole)
        assert (other.stop_reason, other.usage.output_tokens) == (
            whole.stop_reason, whole.usage.output_tokens)
    assert "".join(pieces) == "".join(sync_pieces) == text_of(whole)
    assert len(pieces) > 1  # it streamed


def test_the_raw_events_are_anthropic_s_sequence(live_server: LiveServer,
                                                 client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="tiny", messages=HI).input_tokens  # type: ignore[arg-type]
    events = list(client.messages.create(model="tiny", max_tokens=8, messages=HI,  # type: ignore[arg-type]
                                         stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message  # type: ignore[union-attr]
    assert start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == counted
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert delta.usage.output_tokens == 8  # type: ignore[union-attr]
    # On the wire: every data line has its event line (the SDK drops events without one),
    # and a ping follows message_start, as Anthropic sends.
    with httpx.stream("POST", live_server.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 3, "messages": HI, "stream": True},
            headers={"anthropic-version": "2023-06-01"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith(("event:", "data:"))]
    names = [line.split(": ", 1)[1] for line in lines[0::2]]
    assert all(json.loads(data.split(": ", 1)[1])["type"] == name
               for name, data in zip(names, lines[1::2]))
    assert names[:2] == ["message_start", "ping"]


def test_a_stop_sequence_ends_the_message_and_is_named(client: anthropic.Anthropic) -> None:
    free = text_of(client.messages.create(model="tiny", max_tokens=16, messages=HI))  # type: ignore[arg-type]
    stop = free[len(free) // 2:][:3]
    assert stop.strip(), free
    expected = free[:free.find(stop)]
    message = client.messages.create(model="tiny", max_tokens=16, messages=HI,  # type: ignore[arg-type]
                                     stop_sequences=["never-written", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == expected
    with client.messages.stream(model="tiny", max_tokens=16, messages=HI,  # type: ignore[arg-type]
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, text_of(streamed)) == (
        "stop_sequence", stop, expected)
    unmatched = client.messages.create(model="tiny", max_tokens=16, messages=HI,  # type: ignore[arg-type]
                                       stop_sequences=["never-written"])
    assert unmatched.stop_sequence is None and text_of(unmatched) == free


def test_count_tokens_is_what_the_message_s_prompt_costs(client: anthropic.Anthropic,
                                                         server_engine: Engine) -> None:
    tool = {"name": "pick", "description": "Pick a colour.", "input_schema": {
        "type": "object", "properties": {"colour": {"type": "string"}}}}
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=HI,  # type: ignore[arg-type]
                                           tools=[tool])  # type: ignore[list-item]
    own = server_engine.count_tokens(ChatRequest.from_openai(
        [{"role": "system", "content": SYSTEM}, *HI],
        tools=[{"type": "function", "function": {"name": "pick", "description": "Pick a colour.",
                                                 "parameters": tool["input_schema"]}}]))
    assert counted.input_tokens == own
    message = client.messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=HI,  # type: ignore[arg-type]
                                     tools=[tool])  # type: ignore[list-item]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == own
    without_tools = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=HI)  # type: ignore[arg-type]
    assert without_tools.input_tokens < own
    none = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=HI,  # type: ignore[arg-type]
                                        tools=[tool], tool_choice={"type": "none"})  # type: ignore[list-item]
    assert none.input_tokens == without_tools.input_tokens  # "none": the tools are not shown


def test_a_repeated_prompt_reads_the_prefix_cache(client: anthropic.Anthropic) -> None:
    long = [{"role": "user", "content": "Tell me about the cache. " * 20}]
    first = client.messages.create(model="tiny", max_tokens=2, messages=long)  # type: ignore[arg-type]
    second = client.messages.create(model="tiny", max_tokens=2, messages=long)  # type: ignore[arg-type]
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.input_tokens < first.usage.input_tokens


class Pick(BaseModel):
    colour: Literal["red", "blue"]


def test_structured_output_by_output_config_and_by_parse(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    message = client.messages.create(
        model="tiny", max_tokens=40, messages=[{"role": "user", "content": "Pick one."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    assert json.loads(text_of(message))["colour"] in ("red", "blue")
    parsed = client.messages.parse(model="tiny", max_tokens=40, output_format=Pick,
                                   messages=[{"role": "user", "content": "Pick one."}])
    assert isinstance(parsed.parsed_output, Pick)


def test_sampling_options_as_extra_body(client: anthropic.Anthropic) -> None:
    """anthropic 2.x's ``messages.create`` has no temperature, top_p or top_k (gone since
    1.0): they go as ``extra_body``, with this server's own options."""
    seeded = {"model": "tiny", "max_tokens": 10, "messages": HI, "extra_body": {
        "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 5, "min_p": 0.01}}
    assert text_of(client.messages.create(**seeded)) == text_of(  # type: ignore[call-overload]
        client.messages.create(**seeded))  # type: ignore[call-overload]
    message = client.messages.create(model="tiny", max_tokens=5, messages=HI,  # type: ignore[arg-type]
                                     extra_body={"logprobs": True, "top_logprobs": 2})
    logprobs = (message.model_extra or {})["logprobs"]["content"]
    assert len(logprobs) == 5 and all(len(entry["top_logprobs"]) == 2 for entry in logprobs)


def test_errors_are_the_sdk_s_exceptions(live_server: LiveServer,
                                         client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=2, messages=HI)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]\.type"):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Read this."},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model="tiny", max_tokens=2, messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "word " * 5000}])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    reply = httpx.post(live_server.url + "/v1/messages", timeout=30, json={
        "model": "tiny", "messages": HI})
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]["message"]


def test_max_tokens_past_the_context_is_a_ceiling(client: anthropic.Anthropic,
                                                  server_engine: Engine) -> None:
    """LangChain's ChatAnthropic sends 4096 for a model it does not know (the tiny model's
    context is 2048): the answer is cut where the context ends, not refused."""
    limit = server_engine.context_limit
    assert limit is not None
    message = client.messages.create(model="tiny", max_tokens=limit + 100, messages=HI,  # type: ignore[arg-type]
                                      stop_sequences=[" "])
    assert message.stop_reason in ("end_turn", "stop_sequence", "max_tokens")


def test_the_beta_path_and_version_headers_are_accepted(client: anthropic.Anthropic) -> None:
    message = client.beta.messages.create(model="tiny", max_tokens=4, messages=HI,  # type: ignore[arg-type]
                                          betas=["interleaved-thinking-2025-05-14"])
    assert message.type == "message" and message.usage.output_tokens == 4


def test_the_api_key_goes_as_x_api_key_or_bearer(serve: Serve) -> None:
    server, _ = serve(ServerSettings(api_key="s3cret"))
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "messages": HI}
    for sdk in (anthropic.Anthropic(base_url=server.url, api_key="s3cret", max_retries=0),
                anthropic.Anthropic(base_url=server.url, auth_token="s3cret", max_retries=0)):
        assert sdk.messages.create(**ask).usage.output_tokens == 2
        assert sdk.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**ask)
    assert refused.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "missing or incorrect API key: send "
        "'Authorization: Bearer <key>' or 'x-api-key: <key>'"}}


def test_a_full_queue_is_overloaded_529_with_retry_after(
        serve: Serve, slow_steps: Callable[[float], None]) -> None:
    server, eng = serve(ServerSettings(max_queue=1), max_batch=1)
    slow_steps(0.05)
    sdk = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    long = {"model": "tiny", "max_tokens": 500, "messages": HI}
    with sdk.messages.stream(**long) as running:  # type: ignore[arg-type]
        next(iter(running))
        held: list[Any] = []
        waiter = threading.Thread(target=lambda: held.append(sdk.messages.create(
            model="tiny", max_tokens=2, messages=HI)))  # type: ignore[arg-type]
        waiter.start()  # the queued one: max_batch 1 + max_queue 1 is now full
        wait_until(lambda: eng.stats().pending == 1)
        with pytest.raises(anthropic.OverloadedError) as shed:
            sdk.messages.create(model="tiny", max_tokens=2, messages=HI)  # type: ignore[arg-type]
        assert shed.value.status_code == 529
        assert shed.value.response.headers["retry-after"] == "1"
        assert shed.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    waiter.join(60)
    assert held and held[0].usage.output_tokens == 2
    metrics = httpx.get(server.url + "/metrics", timeout=10).text  # shed, not failed
    assert 'mlx_server_requests_total{endpoint="messages",outcome="rejected"} 1.0' in metrics


def test_closing_a_message_stream_evicts_its_row(
        serve: Serve, slow_steps: Callable[[float], None]) -> None:
    slow_steps(0.02)
    server, eng = serve()
    sdk = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with sdk.messages.stream(model="tiny", max_tokens=1500, messages=HI) as stream:  # type: ignore[arg-type]
        for _, _ in zip(range(6), stream, strict=False):
            pass
        assert eng.stats().running == 1
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=10)
    assert eng.stats().completed == 0 and eng.stats().generated_tokens < 200
    with pytest.raises(anthropic.APITimeoutError):  # a whole message whose client gave up
        sdk.messages.create(model="tiny", max_tokens=1500, messages=HI, timeout=0.6)  # type: ignore[arg-type]
    wait_until(lambda: eng.stats().cancelled == 2, timeout=10)
    assert eng.stats().completed == 0
