"""The engine's results as LlamaIndex's replies (pure, no model): a finished ``Completion``
as a ``ChatResponse`` or ``CompletionResponse`` (reasoning, tool calls, usage, logprobs), and
a request's stream events as chunks with their delta and everything so far.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    LogProb,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

from engine import (
    Completion,
    InvalidToolCall,
    StreamEvent,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """Engine usage for LlamaIndex's token counting (``raw["usage"]``): its keys are the
    engine's own (``Usage.as_dict``)."""
    return usage.as_dict()


def _invalid_dict(call: InvalidToolCall) -> dict[str, Any]:
    """An unparsed call as plain JSON data (raw responses get serialised by tracers)."""
    return {"id": call.id, "name": call.name, "raw": call.raw, "error": call.error}


def final_raw(completion: Completion, model_name: str) -> dict[str, Any]:
    """``ChatResponse.raw`` of a finished request: usage, finish reason, unparsed calls."""
    return {"model": model_name,
            "finish_reason": completion.finish_reason.value,
            "usage": usage_dict(completion.usage),
            "invalid_tool_calls": [_invalid_dict(c) for c in completion.invalid_tool_calls],
            "truncated": completion.truncated}


def assistant_message(content: str, reasoning: str | None,
                      tool_calls: Sequence[ToolCall] = ()) -> ChatMessage:
    """The assistant's turn: thinking first, then the answer text, then its tool calls."""
    if tool_calls and not content.strip():
        content = ""  # the newlines between calls are not an answer
    blocks: list[Any] = []
    if reasoning:
        blocks.append(ThinkingBlock(content=reasoning))
    blocks.append(TextBlock(text=content))
    blocks.extend(ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments))
                  for c in tool_calls)
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


# LlamaIndex's logprobs: one list per generated token.
TokenLogProbs = list[list[LogProb]]


def llama_logprobs(openai: Mapping[str, Any] | None) -> TokenLogProbs | None:
    """OpenAI's ``logprobs`` object (``engine.openai_logprobs``) as LlamaIndex's: one list
    per generated token, the chosen token first, then its ``top_logprobs`` alternatives
    (most likely first; none unless asked for). llama-index-llms-openai lists only the
    alternatives, and nothing without them; the chosen token first keeps what was chosen,
    and its logprob, with or without alternatives (``[1:]`` is OpenAI's list)."""
    if openai is None:
        return None
    return [[LogProb(token=entry["token"], logprob=entry["logprob"], bytes=entry["bytes"]),
             *(LogProb(**alternative) for alternative in entry["top_logprobs"])]
            for entry in openai["content"]]


def chat_response(completion: Completion, model_name: str, delta: str | None = None,
                  extra: Mapping[str, Any] | None = None,
                  logprobs: TokenLogProbs | None = None) -> ChatResponse:
    """A whole (or the last streamed) chat response built from the engine's Completion."""
    message = assistant_message(completion.content, completion.reasoning, completion.tool_calls)
    return ChatResponse(message=message, delta=delta, raw=final_raw(completion, model_name),
                        additional_kwargs=dict(extra or {}), logprobs=logprobs)


def completion_response(completion: Completion, model_name: str, delta: str | None = None,
                        extra: Mapping[str, Any] | None = None,
                        logprobs: TokenLogProbs | None = None) -> CompletionResponse:
    """A whole (or the last streamed) completion; reasoning goes to additional_kwargs."""
    additional = dict(extra or {})
    if completion.reasoning:
        additional["reasoning"] = completion.reasoning
    return CompletionResponse(text=completion.content, delta=delta,
                              raw=final_raw(completion, model_name), additional_kwargs=additional,
                              logprobs=logprobs)


# A request's logprobs converter: its tokens' -> OpenAI's object (None unless it asked).
ToOpenAILogprobs = Callable[[Sequence[TokenLogprob] | None], Mapping[str, Any] | None]


class StreamChunks:
    """Turns a request's stream events into LlamaIndex chunks with delta and accumulation.

    Tool calls stream as they are written (a call's name, then its argument fragments): a
    chunk that brings call pieces lists them in ``additional_kwargs["tool_call_deltas"]``
    (OpenAI's delta shape), and its message holds every call whose arguments are whole so
    far as ``ToolCallBlock``s, so an agent reading any chunk's message sees whole calls only.
    Logprobs, when asked for, accumulate as the text does: each chunk's ``logprobs`` are
    every token's so far (the last chunk's equal the whole response's); a chunk's new ones
    are those past the previous chunk's (a token whose text is held back for a stop
    string, or is call markup, comes on a chunk with an empty ``delta``).
    """

    def __init__(self, model_name: str,
                 check: Callable[[Completion], Completion] | None = None,
                 logprobs: ToOpenAILogprobs | None = None) -> None:
        """Start with nothing accumulated; ``model_name`` goes into the last chunk's raw;
        ``check`` sees the finished completion first (it raises for a cut forced call);
        ``logprobs`` converts an event's logprobs (None: none were asked for)."""
        self.model_name = model_name
        self.check = check
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, Any]] = {}  # index -> id, name, arguments text
        self.convert = logprobs
        self.logprobs: TokenLogProbs | None = None  # so far; stays None unless asked

    def chat(self, event: StreamEvent) -> ChatResponse | None:
        """The chat chunk for ``event``; None for events with nothing to show (call markup)."""
        extra: dict[str, Any] = {"thinking_delta": event.reasoning} if event.reasoning else {}
        if event.tool_call_deltas:
            extra["tool_call_deltas"] = [delta_dict(d) for d in event.tool_call_deltas]
        new_logprobs = self._add_logprobs(event)
        if event.completion is not None:  # the last event: the whole turn, calls and usage
            completion = self.check(event.completion) if self.check else event.completion
            return chat_response(completion, self.model_name, event.content, extra,
                                 self.logprobs)
        if not self._feed(event) and not new_logprobs:
            return None
        message = assistant_message(self.content, self.reasoning or None, self._calls())
        return ChatResponse(message=message, delta=event.content, additional_kwargs=extra,
                            logprobs=self.logprobs)

    def _calls(self) -> list[ToolCall]:
        """The calls streamed so far whose arguments are whole (JSON that parses)."""
        whole: list[ToolCall] = []
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"])
            except ValueError:
                continue  # pieces of a call still streaming
            if isinstance(arguments, dict):
                whole.append(ToolCall(call["id"], call["name"], arguments))
        return whole

    def completion(self, event: StreamEvent) -> CompletionResponse | None:
        """The completion chunk for ``event``; None when it adds no text."""
        extra = {"thinking_delta": event.reasoning} if event.reasoning else {}
        new_logprobs = self._add_logprobs(event)
        if event.completion is not None:
            return completion_response(event.completion, self.model_name, event.content, extra,
                                       self.logprobs)
        if not self._feed(event) and not new_logprobs:
            return None
        return CompletionResponse(text=self.content, delta=event.content, additional_kwargs=extra,
                                  logprobs=self.logprobs)

    def _feed(self, event: StreamEvent) -> bool:
        """Accumulate the event's text and call pieces; False when it carries neither."""
        self.content += event.content
        self.reasoning += event.reasoning
        for delta in event.tool_call_deltas:
            call = self.calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id or ""
            call["name"] = call["name"] or delta.name or ""
            call["arguments"] += delta.arguments
        return bool(event.content or event.reasoning or event.tool_call_deltas)

    def _add_logprobs(self, event: StreamEvent) -> bool:
        """Accumulate the event's tokens' logprobs (a token whose text is held back, or is
        call markup, brings its logprob all the same); False when it brings none."""
        tokens = llama_logprobs(self.convert(event.logprobs)) if self.convert else None
        if tokens is None:
            return False
        # A new list, not an append: the chunks handed out already keep theirs.
        self.logprobs = [*(self.logprobs or ()), *tokens]
        return bool(tokens)


def delta_dict(delta: ToolCallDelta) -> dict[str, Any]:
    """A tool-call delta in OpenAI's streaming shape (id and name on a call's first)."""
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        function["name"] = delta.name
    out: dict[str, Any] = {"index": delta.index, "function": function}
    if delta.id is not None:
        out.update(id=delta.id, type="function")
    return out
