"""Streamed tool calls on SmolLM2-135M-Instruct, which makes real calls: in process and
through the ``openai`` SDK over loopback, a stream adds up to the calls a whole answer has.

The engine streams each call once it keeps it (``StreamEvent.tool_call_deltas``), so a
call it drops (a repeat, a malformed or cut one) is never sent. Part of ``make test-real``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool

from mlx_providers import ChatMLXBatch
from mlx_providers.server import create_app
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.real
QUESTION = "What is the weather in Paris and the time in Tokyo?"


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return "sunny"


@tool
def get_time(tz: str) -> str:
    """Current time in a time zone."""
    return "noon"


def calls_of(message: Any) -> tuple[list[Any], int]:
    """(name, args) of the kept calls, and how many were invalid (ids differ per request)."""
    return [(c["name"], c["args"]) for c in message.tool_calls], len(message.invalid_tool_calls)


async def summed(model: Any, question: str) -> tuple[AIMessageChunk, list[AIMessageChunk]]:
    chunks = [chunk async for chunk in model.astream(question)]
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full, chunks


@pytest.mark.parametrize("choice", ["any", "get_weather"])
async def test_langchain_stream_adds_up_to_invoke(choice: str) -> None:
    model = ChatMLXBatch(max_tokens=128, temperature=0).bind_tools(
        [get_weather, get_time], tool_choice=choice)
    invoked = await model.ainvoke(QUESTION)
    full, chunks = await summed(model, QUESTION)
    kept, invalid = calls_of(invoked)
    assert kept and invalid == 0 and calls_of(full) == (kept, 0)
    assert all(name == "get_weather" for name, _ in kept) or choice == "any"
    if len(kept) > 1:  # the first call is out before the answer ends
        first = next(i for i, c in enumerate(chunks) if c.tool_call_chunks)
        assert first < len(chunks) - 1


async def test_langchain_stream_of_a_cut_call_adds_up_to_invoke() -> None:
    """max_tokens cuts the second call: it is invalid in both, never a partial valid call."""
    whole = ChatMLXBatch(max_tokens=128, temperature=0).bind_tools(
        [get_weather, get_time], tool_choice="any")
    made = await whole.ainvoke(QUESTION)
    assert len(made.tool_calls) == 2 and made.usage_metadata is not None
    limit = made.usage_metadata["output_tokens"] - 4  # inside the second call's arguments
    model = ChatMLXBatch(max_tokens=limit, temperature=0).bind_tools(
        [get_weather, get_time], tool_choice="any", raise_on_truncated_call=False)
    invoked = await model.ainvoke(QUESTION)
    full, _ = await summed(model, QUESTION)
    assert calls_of(invoked) == ([(made.tool_calls[0]["name"], made.tool_calls[0]["args"])], 1)
    assert calls_of(full) == calls_of(invoked)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = ChatMLXBatch().engine  # the process's default-model engine (the app never closes it)
    server = LiveServer(create_app({"smol": engine})).start()
    yield openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    server.stop()


TOOLS: Any = [{"type": "function", "function": {
    "name": t.name, "description": t.description,
    "parameters": t.tool_call_schema.model_json_schema()}} for t in (get_weather, get_time)]


@pytest.mark.parametrize("max_tokens", [128, None])  # None: cut inside the second call
def test_openai_chat_stream_accumulates_to_the_whole_answer(
        client: openai.OpenAI, max_tokens: int | None) -> None:
    ask: Any = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}],
                "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = client.chat.completions.create(**ask, max_tokens=128)
    calls = whole.choices[0].message.tool_calls or []
    assert len(calls) == 2 and whole.usage is not None
    limit = max_tokens or whole.usage.completion_tokens - 4
    if max_tokens is None:
        whole = client.chat.completions.create(**ask, max_tokens=limit)
        calls = whole.choices[0].message.tool_calls or []
        assert len(calls) == 1 and whole.choices[0].finish_reason == "length"
    with client.chat.completions.stream(**ask, max_tokens=limit) as stream:
        for _ in stream:
            pass
        # The SDK's own accumulation (get_final_completion refuses a "length" finish).
        final = stream.current_completion_snapshot
    streamed = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c.id.startswith("call_") for c in streamed)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_responses_stream_gives_the_whole_answers_function_calls(
        client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", **t["function"]} for t in TOOLS]
    ask: Any = {"model": "smol", "input": QUESTION, "tools": tools, "tool_choice": "required",
                "temperature": 0, "max_output_tokens": 128}
    whole = client.responses.create(**ask)
    calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert len(calls) == 2
    events = list(client.responses.create(**ask, stream=True))
    arguments: dict[int, str] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] = arguments.get(event.output_index, "") + event.delta
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == calls  # type: ignore[union-attr]
    assert [arguments[e.output_index] for e in done] == [a for _, a in calls]  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls
