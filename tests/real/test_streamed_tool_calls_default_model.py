"""Streamed tool calls on SmolLM2-135M-Instruct, which makes real calls: in process and
through the ``openai`` SDK over loopback, a stream adds up to the calls a whole answer has.

The engine streams a call's name once it is written and its arguments as fragments
(``StreamEvent.tool_call_deltas``); a call it may still drop (a repeat) is held back. A call
that max_tokens cuts was sent as far as it was written, as OpenAI does: the whole answer
lists it as invalid and finishes with ``length``. Part of ``make test-real``.
"""

from __future__ import annotations

import json
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


async def test_langchain_stream_of_a_cut_call_sends_what_was_written() -> None:
    """max_tokens cuts the second call inside its arguments. ``invoke`` lists it invalid; the
    stream sent its name and the arguments written so far (a prefix of the whole answer's),
    as ChatOpenAI does, so the summed stream is not ``invoke`` for that call (LangChain's
    partial-JSON parse may show it as a call): OpenAI semantics, finish reason length. The
    kept first call is the same in both."""
    whole = ChatMLXBatch(max_tokens=128, temperature=0).bind_tools(
        [get_weather, get_time], tool_choice="any")
    made = await whole.ainvoke(QUESTION)
    assert len(made.tool_calls) == 2 and made.usage_metadata is not None
    first = (made.tool_calls[0]["name"], made.tool_calls[0]["args"])
    invoked = None
    for limit in range(made.usage_metadata["output_tokens"] - 2, 0, -1):
        model = ChatMLXBatch(max_tokens=limit, temperature=0).bind_tools(
            [get_weather, get_time], tool_choice="any", raise_on_truncated_call=False)
        invoked = await model.ainvoke(QUESTION)
        if len(invoked.tool_calls) == 1:  # the largest cut inside the second call
            break
    assert invoked is not None and calls_of(invoked) == ([first], 1)
    assert invoked.response_metadata["finish_reason"] == "length"
    raw = invoked.invalid_tool_calls[0]["args"]
    full, chunks = await summed(model, QUESTION)
    assert full.response_metadata["finish_reason"] == "length"
    assert [(c["name"], c["args"]) for c in full.tool_calls][:1] == [first]
    pieces = [c for chunk in chunks for c in chunk.tool_call_chunks if c["index"] == 1]
    sent = "".join(c["args"] or "" for c in pieces)
    assert pieces[0]["name"] == made.tool_calls[1]["name"] == invoked.invalid_tool_calls[0]["name"]
    assert sent and raw.endswith(sent)  # the arguments as far as they were written
    assert json.dumps(made.tool_calls[1]["args"]).startswith(sent)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = ChatMLXBatch().engine  # the process's default-model engine (the app never closes it)
    server = LiveServer(create_app({"smol": engine})).start()
    yield openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    server.stop()


TOOLS: Any = [{"type": "function", "function": {
    "name": t.name, "description": t.description,
    "parameters": t.tool_call_schema.model_json_schema()}} for t in (get_weather, get_time)]


def test_openai_chat_stream_accumulates_to_the_whole_answer(client: openai.OpenAI) -> None:
    ask: Any = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}],
                "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 128}
    whole = client.chat.completions.create(**ask)
    calls = whole.choices[0].message.tool_calls or []
    assert len(calls) == 2
    pieces: dict[int, list[Any]] = {}
    with client.chat.completions.stream(**ask) as stream:
        for event in stream:
            if event.type == "chunk":
                for delta in event.chunk.choices[0].delta.tool_calls or ():
                    pieces.setdefault(delta.index, []).append(delta)
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c.id.startswith("call_") for c in streamed)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    for index, deltas in pieces.items():  # the name first, then argument fragments
        assert deltas[0].id == streamed[index].id and deltas[0].function.name
        assert deltas[0].function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        assert len(deltas) > 2, deltas


def test_openai_chat_stream_of_a_cut_call_sends_what_was_written(client: openai.OpenAI) -> None:
    """max_tokens cuts the second call inside its arguments: the stream sent its name and
    the arguments written so far (a prefix of the uncut answer's), finish reason length; the
    whole answer (OpenAI's chat shape has no invalid calls) has the first call only."""
    ask: Any = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}],
                "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    uncut = client.chat.completions.create(**ask, max_tokens=128)
    full_calls = uncut.choices[0].message.tool_calls or []
    assert len(full_calls) == 2 and uncut.usage is not None
    for limit in range(uncut.usage.completion_tokens - 2, 0, -1):
        whole = client.chat.completions.create(**ask, max_tokens=limit)
        calls = whole.choices[0].message.tool_calls or []
        if len(calls) == 1:  # the largest cut inside the second call
            break
    assert whole.choices[0].finish_reason == "length"
    with client.chat.completions.stream(**ask, max_tokens=limit) as stream:
        for _ in stream:
            pass
        # The SDK's own accumulation (get_final_completion refuses a "length" finish).
        final = stream.current_completion_snapshot
    streamed = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in streamed[:1]] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert len(streamed) == 2 and streamed[1].function.name == full_calls[1].function.name
    assert full_calls[1].function.arguments.startswith(streamed[1].function.arguments)


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
    for e in done:  # the item opens (with its name) first, then the arguments in fragments
        at = [i for i, x in enumerate(events) if getattr(x, "output_index", None)
              == e.output_index]  # type: ignore[union-attr]
        kinds = [events[i].type for i in at]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
        assert kinds.count("response.function_call_arguments.delta") > 1
    assert [(e.name, e.arguments) for e in done] == calls  # type: ignore[union-attr]
    assert [arguments[e.output_index] for e in done] == [a for _, a in calls]  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls
