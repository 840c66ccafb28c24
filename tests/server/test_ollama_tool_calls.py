"""What the engine answers reaches each Ollama client as Ollama sends it: tool calls,
thinking, a failure mid-stream; and what each client sends reaches the engine (options,
``format``, ``think``). A scripted engine answers (the tiny random model calls no tool by
itself); the clients are the real ``ollama``, ``langchain-ollama`` and
``llama-index-llms-ollama`` over loopback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import ollama
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama

from engine import EngineError, JsonObject, JsonSchema, ToolCall
from mlx_providers.server import ServerSettings, create_app
from tests.fake_engine import Reply, ScriptedEngine, Submitted
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(60)
CALL = ToolCall("call_abc", "get_weather", {"city": "Paris"})
HELLO = [{"role": "user", "content": "Weather in Paris?"}]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def answer(call: Submitted) -> Reply:
    """A call when the request offers tools, thinking when asked to think, else text."""
    if call.tools:
        return Reply(pieces=(), tool_calls=(CALL,))
    if (call.chat_template_kwargs or {}).get("enable_thinking"):
        return Reply(pieces=("Sunny.",), reasoning="Let me think.")
    if call.params.stop == ("FAIL",):
        return Reply(pieces=("Part",), error=EngineError("simulated failure"))
    return Reply()


@pytest.fixture(scope="module")
def fake() -> ScriptedEngine:
    return ScriptedEngine(reply=answer)


@pytest.fixture(scope="module")
def server(fake: ScriptedEngine) -> Iterator[LiveServer]:
    live = LiveServer(create_app(
        {"m": fake}, settings=ServerSettings(default_max_tokens=64),  # type: ignore[dict-item]
        embeddings={})).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=30)


def test_a_call_is_in_message_tool_calls_with_object_arguments(client: ollama.Client) -> None:
    reply = client.chat(model="m", messages=HELLO, tools=[get_weather_schema()])
    [call] = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert reply.done_reason == "stop" and reply.message.content == ""
    chunks = list(client.chat(model="m", messages=HELLO, tools=[get_weather_schema()],
                              stream=True))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and chunks[-1].done
    assert with_calls[0].message.tool_calls == reply.message.tool_calls


def get_weather_schema() -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}


def test_chat_ollama_bind_tools_invoke_and_stream(server: LiveServer) -> None:
    llm = ChatOllama(model="m", base_url=server.url).bind_tools([get_weather])
    message = llm.invoke("Weather in Paris?")
    assert isinstance(message, AIMessage)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    streamed = None
    for chunk in llm.stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [  # type: ignore[attr-defined]
        ("get_weather", {"city": "Paris"})]


def test_llama_index_reads_the_call(server: LiveServer) -> None:
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.ollama import Ollama

    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    weather.__annotations__ = {"city": str, "return": str}  # strings under __future__
    llm = Ollama(model="m", base_url=server.url, request_timeout=30, context_window=2048)
    response = llm.chat_with_tools([FunctionTool.from_defaults(weather)],
                                   user_msg="Weather in Paris?")
    [selection] = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert selection.tool_name == "get_weather" and selection.tool_kwargs == {"city": "Paris"}


def test_think_turns_reasoning_on_and_comes_back_as_thinking(
        client: ollama.Client, server: LiveServer, fake: ScriptedEngine) -> None:
    reply = client.chat(model="m", messages=HELLO, think=True)
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": True}
    assert reply.message.thinking == "Let me think." and reply.message.content == "Sunny."
    # Whole (the scripted engine streams no reasoning events; a real one does).
    message = ChatOllama(model="m", base_url=server.url, reasoning=True).invoke(
        "Weather?", stream=False)
    assert message.additional_kwargs["reasoning_content"] == "Let me think."
    assert message.content == "Sunny."
    client.chat(model="m", messages=HELLO, think=False)
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": False}
    client.chat(model="m", messages=HELLO, think="high")
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": True,
                                                   "reasoning_effort": "high"}
    client.generate(model="m", prompt="Hi", think=True)
    assert fake.calls[-1].chat_template_kwargs == {"enable_thinking": True}


def test_a_failure_mid_stream_is_an_error_line_the_client_raises(
        client: ollama.Client) -> None:
    seen: list[Any] = []
    with pytest.raises(ollama.ResponseError, match="simulated failure"):
        for chunk in client.chat(model="m", messages=HELLO, stream=True,
                                 options={"stop": ["FAIL"]}):
            seen.append(chunk)
    assert [c.message.content for c in seen] == ["Part"]  # what came before the failure
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="m", messages=HELLO, options={"stop": ["FAIL"]})
    assert raised.value.status_code == 500


def test_options_as_the_engine_reads_them(client: ollama.Client,
                                          fake: ScriptedEngine) -> None:
    client.chat(model="m", messages=HELLO, options={
        "num_predict": 9, "repeat_penalty": 1.3, "repeat_last_n": 32, "num_ctx": 8192,
        "mirostat": 0, "presence_penalty": 0.5, "temperature": 0.4})
    params = fake.calls[-1].params
    assert (params.max_tokens, params.repetition_penalty, params.repetition_context_size,
            params.temperature) == (9, 1.3, 32, 0.4)
    # Ollama's "no limit" and "random seed" are the server's defaults; a penalty of 1 is off.
    client.chat(model="m", messages=HELLO, options={"num_predict": -1, "seed": -1,
                                                    "repeat_penalty": 1.0})
    params = fake.calls[-1].params
    assert (params.max_tokens, params.seed, params.repetition_penalty) == (64, None, None)
    assert params.temperature == 0.0  # the server's --temperature, not Ollama's 0.8
    client.chat(model="m", messages=HELLO, format="json")
    assert isinstance(fake.calls[-1].params.constraint, JsonObject)
    client.generate(model="m", prompt="Hi", format={"type": "object"})
    assert isinstance(fake.calls[-1].params.constraint, JsonSchema)
    client.chat(model="m", messages=HELLO, top_logprobs=3)  # alone, it asks for logprobs
    assert (fake.calls[-1].params.logprobs, fake.calls[-1].params.top_logprobs) == (True, 3)


def test_null_fields_are_their_defaults(server: LiveServer) -> None:
    reply = httpx.post(server.url + "/api/chat", timeout=30, json={
        "model": "m", "messages": HELLO, "stream": None, "options": None, "logprobs": None,
        "format": None, "think": None, "keep_alive": None, "tools": None})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/x-ndjson")  # streamed
    lines = [json.loads(line) for line in reply.text.splitlines()]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])


def test_chat_ollama_sends_what_the_engine_reads(server: LiveServer,
                                                 fake: ScriptedEngine) -> None:
    llm = ChatOllama(model="m:latest", base_url=server.url, temperature=0.3, top_k=7,
                     num_predict=5, stop=["END"], seed=3)
    assert llm.invoke("Hello").content == "Hello from the script."
    params = fake.calls[-1].params
    assert (params.temperature, params.top_k, params.max_tokens, params.stop,
            params.seed) == (0.3, 7, 5, ("END",), 3)


def test_structured_output_sends_the_schema_as_format(server: LiveServer,
                                                      fake: ScriptedEngine) -> None:
    from pydantic import BaseModel

    class Pick(BaseModel):
        colour: Literal["red", "blue"]

    fake.reply = Reply(pieces=('{"colour": "red"}',))
    try:
        picked = ChatOllama(model="m", base_url=server.url).with_structured_output(
            Pick).invoke("Pick one.")
    finally:
        fake.reply = answer
    assert picked == Pick(colour="red")
    constraint = fake.calls[-1].params.constraint
    assert isinstance(constraint, JsonSchema)
