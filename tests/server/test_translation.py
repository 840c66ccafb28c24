"""Chat-completion chunks and Responses events, each from engine events (pure, no model).

Reasoning models are hard to drive from a random-weight model over HTTP, so the
reasoning paths are checked here on hand-made engine events.
"""

from __future__ import annotations

import json
from typing import Any

from engine import (
    Completion,
    FinishReason,
    InvalidToolCall,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from mlx_providers.server.chat_completions import ChatCompletionShaper
from mlx_providers.server.responses_events import ResponseTranslator
from mlx_providers.server.responses_request import messages_of

USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)


def events(finish: FinishReason = FinishReason.STOP,
           calls: tuple[ToolCall, ...] = ()) -> list[StreamEvent]:
    completion = Completion("raw", (1, 2, 3, 4, 5), finish, USAGE, content="Hi there",
                            reasoning="let me see", tool_calls=calls)
    deltas = tuple(ToolCallDelta(i, c.id, c.name, c.arguments_text)
                   for i, c in enumerate(calls))  # as the engine streams kept calls
    return [StreamEvent("<think>let", reasoning="let"),
            StreamEvent(" me see</think>", reasoning=" me see"),
            StreamEvent("Hi", content="Hi"),
            StreamEvent(" there", content=" there", finish_reason=finish, usage=USAGE,
                        completion=completion, tool_call_deltas=deltas)]


def chunks_of(stream: list[StreamEvent], **kw: Any) -> list[dict[str, Any]]:
    shaper = ChatCompletionShaper("m", str, **kw)
    out = [shaper.first_chunk()]
    for event in stream:
        out += shaper.event_chunks(event)
    return out


def test_reasoning_streams_as_reasoning_content_deltas() -> None:
    chunks = chunks_of(events(), include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "let me see"
    assert "".join(d.get("content") or "" for d in deltas) == "Hi there"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 0}}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_a_whole_completion_carries_reasoning_and_calls() -> None:
    call = ToolCall("call_abc", "f", {"x": 1})
    completion = events(FinishReason.TOOL_CALLS, (call,))[-1].completion
    assert completion is not None
    body = ChatCompletionShaper("m", str).completion(completion)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "let me see"
    assert message["tool_calls"] == [{"id": "call_abc", "type": "function",
                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def translate(stream: list[StreamEvent]) -> tuple[ResponseTranslator, list[dict[str, Any]]]:
    translator = ResponseTranslator("m", {"instructions": None})
    out = translator.start()
    for event in stream:
        out += translator.feed(event)
    return translator, out


def test_responses_events_for_reasoning_text_and_calls() -> None:
    call = ToolCall("call_abc", "f", {"x": 1})
    translator, out = translate(events(FinishReason.TOOL_CALLS, (call,)))
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert final["status"] == "completed"
    reasoning, message, function_call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "let me see"}]
    assert message["content"][0]["text"] == "Hi there" and message["status"] == "completed"
    assert function_call["call_id"] == "call_abc" and json.loads(
        function_call["arguments"]) == {"x": 1}
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4
    # Each item's events name it by the output index it has in the final response.
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    assert translator.done


def test_a_response_cut_by_max_tokens_is_incomplete() -> None:
    _, out = translate(events(FinishReason.LENGTH))
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_failure_and_cancellation_states() -> None:
    translator = ResponseTranslator("m", {})
    translator.start()
    translator.feed(events()[0])
    [error] = translator.fail("boom")
    assert error["type"] == "error" and error["code"] == "server_error"
    assert translator.response()["status"] == "failed"
    cancelled = ResponseTranslator("m", {})
    cancelled.start()
    for event in events()[:3]:  # the reasoning, then "Hi"
        cancelled.feed(event)
    cancelled.cancel()
    response = cancelled.response()
    assert response["status"] == "cancelled"
    assert response["output"][-1]["content"][0]["text"] == "Hi"  # the part generated


def test_streamed_call_pieces_add_up_to_the_whole_call_in_both_formats() -> None:
    """A call in pieces (id and name first, then arguments fragments) is one call."""
    call = ToolCall("call_abc", "f", {"x": [1, 2]})
    pieces = (ToolCallDelta(0, call.id, call.name, ""), ToolCallDelta(0, arguments='{"x": '),
              ToolCallDelta(0, arguments="[1, 2]}"))
    completion = Completion("raw", (1,), FinishReason.TOOL_CALLS, USAGE, tool_calls=(call,))
    stream = [StreamEvent("a", tool_call_deltas=pieces[:2]),
              StreamEvent("b", tool_call_deltas=pieces[2:], finish_reason=FinishReason.TOOL_CALLS,
                          usage=USAGE, completion=completion)]
    chunks = chunks_of(stream)
    entries = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", ())]
    assert entries[0] == {"index": 0, "id": "call_abc", "type": "function",
                          "function": {"name": "f", "arguments": ""}}
    assert all("id" not in e and "name" not in e["function"] for e in entries[1:])
    assert "".join(e["function"]["arguments"] for e in entries) == call.arguments_text
    _, out = translate(stream)
    kinds = [e["type"] for e in out]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    [item] = out[-1]["response"]["output"]
    assert item["arguments"] == call.arguments_text and item["call_id"] == "call_abc"


def test_a_cut_call_ends_as_an_incomplete_item_a_continuation_leaves_out() -> None:
    """max_tokens cut a call after its pieces went out: the item is ``incomplete`` (not the
    call before it), and ``previous_response_id``'s history skips it (it never ran)."""
    kept = ToolCall("call_a", "f", {"x": 1}, '{"x": 1}')
    cut = InvalidToolCall("call_b", "f", '{"name": "f", "arguments": {"x": 2',
                          "the tool call was not closed", 1)
    completion = Completion("raw", (1,), FinishReason.LENGTH, USAGE, tool_calls=(kept,),
                            invalid_tool_calls=(cut,))
    stream = [StreamEvent("a", tool_call_deltas=(ToolCallDelta(0, "call_a", "f", ""),
                                                 ToolCallDelta(0, arguments='{"x": 1}'))),
              StreamEvent("b", tool_call_deltas=(ToolCallDelta(1, "call_b", "f", ""),
                                                 ToolCallDelta(1, arguments='{"x": 2'))),
              StreamEvent("", finish_reason=FinishReason.LENGTH, usage=USAGE,
                          completion=completion)]
    _, out = translate(stream)
    response = out[-1]["response"]
    assert response["status"] == "incomplete"
    assert [(i["call_id"], i["status"], i["arguments"]) for i in response["output"]] == [
        ("call_a", "completed", '{"x": 1}'), ("call_b", "incomplete", '{"x": 2')]
    history = messages_of([{"type": "message", "role": "user", "content": "hi"},
                           *response["output"]], None)
    assert [c.id for m in history for c in m.tool_calls] == ["call_a"]
