"""Adapter plumbing that needs no model, on a scripted engine (``tests/fake_engine.py``):
usage and metadata on the chunks, callbacks, errors, tool calls, settings reaching the
request, early exits cancelling the request. What the engine does with a request (and
the adapters end to end) is tested on the tiny model in the other files here."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage

from engine import EngineError, FinishReason, RequestTimeoutError, ToolCall
from engine.registry import get_engine, shared_engine
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from tests.fake_engine import Reply, ScriptedEngine, scripted

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CUT = Reply(pieces=tuple(f" t{i}" for i in range(48)), finish_reason=FinishReason.LENGTH,
            prompt_tokens=34)


class ChunkCounter(BaseCallbackHandler):
    """Counts LangChain's per-token callbacks."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_the_shared_engine_seam_restores_what_was_shared() -> None:
    outer, inner = ScriptedEngine(), ScriptedEngine()
    with shared_engine("seam-model", outer):
        assert get_engine("seam-model") is outer
        with shared_engine("seam-model", inner):
            assert ChatMLXBatch(model="seam-model").engine is inner
        assert get_engine("seam-model") is outer
    fresh = get_engine("seam-model")  # nothing shared any more: a new (unloaded) engine
    assert fresh is not outer and not isinstance(fresh, ScriptedEngine)
    fresh.close()


def test_usage_and_metadata_ride_on_exactly_one_chunk() -> None:
    counter = ChunkCounter()
    with scripted("lc-usage", CUT):
        chunks = list(ChatMLXBatch(model="lc-usage", max_tokens=48).stream(
            "Hello", config={"callbacks": [counter]}))
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    usage = with_usage[0].usage_metadata
    assert usage is not None
    assert usage["output_tokens"] == 48
    assert usage["total_tokens"] == usage["input_tokens"] + 48 == 34 + 48
    assert usage.get("input_token_details", {}).get("cache_read") == 0
    final = chunks[-1]
    assert final.chunk_position == "last"
    assert final.response_metadata["model_name"] == "lc-usage"
    assert final.response_metadata["model_provider"] == "mlx"
    assert final.response_metadata["finish_reason"] == "length"
    assert all("model_name" not in c.response_metadata for c in chunks[:-1])
    assert len(counter.tokens) == len(chunks)  # on_llm_new_token fired per chunk


def test_streaming_flag_routes_invoke_through_the_stream() -> None:
    counter = ChunkCounter()
    with scripted("lc-streaming", CUT):
        message = ChatMLXBatch(model="lc-streaming", streaming=True).invoke(
            "Hello", config={"callbacks": [counter]})
    assert len(counter.tokens) > 2 and "".join(counter.tokens) == message.content


def test_settings_and_per_call_options_reach_the_request() -> None:
    with scripted("lc-settings") as fake:
        chat = ChatMLXBatch(model="lc-settings", max_tokens=7, temperature=0.3, top_p=0.9,
                            stop=["END"])
        chat.invoke("Hello")
        chat.invoke("Hello", max_tokens=3, temperature=0.0)
    first, second = (call.params for call in fake.calls)
    assert (first.max_tokens, first.temperature, first.top_p, first.stop) == (
        7, 0.3, 0.9, ("END",))
    assert (second.max_tokens, second.temperature) == (3, 0.0)


def test_a_failed_request_raises_its_error_on_every_path() -> None:
    failure = RequestTimeoutError("request 1 timed out after 0.5 s")
    with scripted("lc-errors", Reply(error=failure)):
        chat = ChatMLXBatch(model="lc-errors")
        for run in (lambda: chat.invoke("Hi"), lambda: list(chat.stream("Hi")),
                    lambda: asyncio.run(chat.ainvoke("Hi"))):
            with pytest.raises(RequestTimeoutError, match="timed out"):
                run()


def test_calls_become_tool_calls_on_the_message_and_the_chunks() -> None:
    call = ToolCall("call_1", "get_weather", {"city": "Paris"})
    reply = Reply(pieces=(), finish_reason=FinishReason.TOOL_CALLS, tool_calls=(call,))
    with scripted("lc-tools", reply) as fake:
        model = ChatMLXBatch(model="lc-tools").bind_tools([WEATHER_TOOL])
        message = model.invoke("Weather in Paris?")
        full: Any = None
        for chunk in model.stream("Weather in Paris?"):
            full = chunk if full is None else full + chunk
    assert isinstance(message, AIMessage)
    assert [(c["name"], c["args"], c["id"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "call_1")]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert [t["function"]["name"] for t in fake.calls[0].tools or []] == ["get_weather"]


@pytest.mark.parametrize("options", [
    {"temperature": -1}, {"max_tokens": 0}, {"tools": [{"type": "function", "function": {}}]}])
def test_bad_options_are_refused_before_any_request(options: dict[str, Any]) -> None:
    with scripted("lc-bad-options") as fake:
        with pytest.raises(ValueError, match=r"temperature|max_tokens|name"):
            ChatMLXBatch(model="lc-bad-options").invoke("Hi", **options)
        assert fake.calls == []


def test_leaving_a_stream_early_cancels_its_request() -> None:
    with scripted("lc-early", replace(CUT, held=True)) as fake:
        stream = ChatMLXBatch(model="lc-early").stream("Hello")
        next(stream)
        assert not fake.calls[0].cancelled
        stream.close()
        assert fake.calls[0].cancelled

        async def leave_early() -> None:
            async for _ in ChatMLXBatch(model="lc-early").astream("Hello"):
                break

        asyncio.run(leave_early())
        assert fake.calls[1].cancelled


def test_llama_index_metadata_calls_and_errors() -> None:
    call = ToolCall("call_7", "get_weather", {"city": "Oslo"})
    with scripted("li-scripted", Reply(pieces=(), finish_reason=FinishReason.TOOL_CALLS,
                                       tool_calls=(call,)), context_limit=4096):
        llm = MLXBatchLLM("li-scripted", max_tokens=16)
        meta = llm.metadata
        assert (meta.context_window, meta.num_output, meta.model_name) == (
            4096, 16, "li-scripted")
        response = llm.chat_with_tools([], user_msg="Weather in Oslo?")
        calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert [(c.tool_id, c.tool_name, c.tool_kwargs) for c in calls] == [
        ("call_7", "get_weather", {"city": "Oslo"})]
    failing = Reply(error=EngineError("the model step failed"))
    with scripted("li-failing", failing), pytest.raises(EngineError, match="model step failed"):
        MLXBatchLLM("li-failing").complete("Hi")


def test_a_reasoning_budget_reaches_the_request_from_both_faces() -> None:
    with scripted("budget-faces") as fake:
        ChatMLXBatch(model="budget-faces", reasoning_budget=32).invoke("Hi")
        ChatMLXBatch(model="budget-faces").invoke("Hi", reasoning_budget=8)
        MLXBatchLLM("budget-faces", reasoning_budget=16).complete("Hi")
    assert [c.params.reasoning_budget for c in fake.calls] == [32, 8, 16]


def test_repeat_answered_calls_reaches_the_request_from_both_faces() -> None:
    with scripted("repeat-faces") as fake:
        ChatMLXBatch(model="repeat-faces").invoke("Hi")
        ChatMLXBatch(model="repeat-faces", repeat_answered_calls=True).invoke("Hi")
        ChatMLXBatch(model="repeat-faces").invoke("Hi", repeat_answered_calls=True)
        MLXBatchLLM("repeat-faces").complete("Hi")
        MLXBatchLLM("repeat-faces", repeat_answered_calls=True).complete("Hi")
    assert [c.params.repeat_answered_calls for c in fake.calls] == [
        False, True, True, False, True]


def test_tool_call_limit_reaches_the_request_from_both_faces() -> None:
    with scripted("limit-faces") as fake:
        ChatMLXBatch(model="limit-faces").invoke("Hi")
        ChatMLXBatch(model="limit-faces", tool_call_limit=2).invoke("Hi")
        ChatMLXBatch(model="limit-faces", tool_call_limit=2).invoke("Hi", tool_call_limit=1)
        MLXBatchLLM("limit-faces").complete("Hi")
        MLXBatchLLM("limit-faces", tool_call_limit=3).complete("Hi")
        MLXBatchLLM("limit-faces").complete("Hi", tool_call_limit=1)
    assert [c.params.tool_call_limit for c in fake.calls] == [None, 2, 1, None, 3, 1]
