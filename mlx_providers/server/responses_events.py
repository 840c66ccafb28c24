"""Responses objects and events, translated from the engine's own stream events.

``ResponseTranslator`` reads the ``engine.StreamEvent``s of one generation (reasoning,
content, tool-call deltas, the final event's finish reason and usage) and produces the
Responses event sequence, each event with its ``sequence_number``: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, its deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), their ``….done`` events and
``response.output_item.done``, and last ``response.completed`` or ``response.incomplete``.
The non-streaming endpoint runs the same translator and returns its final response, so
both paths produce the same output items.

Logprobs (when asked for) are those of the message's tokens, in OpenAI's shape (the one
conversion, ``engine.openai_logprobs``): each ``response.output_text.delta`` carries its
tokens', and the part and ``response.output_text.done`` all of them. A token whose text
is still held back (a stop string's possible start) goes with the next text; the tokens
of reasoning and of function calls belong to no output_text and carry none.
"""

from __future__ import annotations

import time
from typing import Any

from engine import (
    Completion,
    FinishReason,
    StreamEvent,
    TokenLogprob,
    TokenText,
    ToolCallDelta,
    Usage,
    openai_logprobs,
)
from mlx_providers.server.chat_completions import new_id

Event = dict[str, Any]


def usage_of(usage: Usage) -> dict[str, Any]:
    """Responses usage from the engine's usage."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


class ResponseTranslator:
    """One response's state: its output items so far, and the events that built them."""

    def __init__(self, model: str, echo: dict[str, Any], response_id: str | None = None,
                 *, token_text: TokenText | None = None) -> None:
        """``token_text``: how a token id reads, when logprobs were asked for (else None)."""
        self.id = response_id or new_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo  # request fields a response repeats (instructions, tools, ...)
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._token_text = token_text
        self._pending: list[TokenLogprob] = []  # tokens whose text no delta carried yet

    # ----- the response object -------------------------------------------------------

    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "error": self.error,
                "incomplete_details": self.incomplete_details, "model": self.model,
                "output": [dict(item) for item in self.output], "usage": self.usage,
                **self.echo}

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    # ----- events ----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, event: StreamEvent) -> list[Event]:
        """The events one engine event becomes (the final one ends the response)."""
        events: list[Event] = []
        if self._token_text is not None:
            self._pending += event.logprobs or ()
        if event.reasoning:
            events += self._text_delta("reasoning", event.reasoning)
        if event.content:
            events += self._text_delta("message", event.content)
        elif event.reasoning or event.tool_call_deltas:
            self._pending = []  # thinking's or a call's tokens: no output_text has them
        for delta in event.tool_call_deltas:
            events += self._call_delta(delta)
        if event.is_final and self._pending and self._open is not None and (
                self._open["type"] == "message"):
            events += self._text_delta("message", "")  # the last tokens, no text of their own
        if event.is_final and event.error is None:
            assert event.finish_reason is not None and event.usage is not None
            events += self._end(event.usage, event.finish_reason, event.completion)
        return events

    def fail(self, message: str) -> list[Event]:
        """Generation failed: the ``error`` event (the stream then closes)."""
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return [self._event("error", code="server_error", message=message, param=None)]

    def cancel(self) -> None:
        """The reader went away: what was generated so far, marked cancelled."""
        self._close_open()
        self.status = "cancelled"

    # ----- items -------------------------------------------------------------------------

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            events += self._open_item(kind)
        assert self._open is not None
        index = len(self.output) - 1
        self._open["_text"] += text
        name = "response.output_text.delta" if kind == "message" else (
            "response.reasoning_text.delta")
        extra: dict[str, Any] = {}
        if kind == "message":
            extra["logprobs"] = self._take_logprobs()
            self._open["_logprobs"] += extra["logprobs"]
        events.append(self._event(name, item_id=self._open["id"], output_index=index,
                                  content_index=0, delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
        self.output.append(item)
        self._open = {"type": kind, "id": item["id"], "_text": "", "_logprobs": []}
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index,
                              item=dict(item))]
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=_output_text("")))
        return events

    def _close_open(self) -> list[Event]:
        if self._open is None:
            return []
        opened, self._open = self._open, None
        index = len(self.output) - 1
        item, text = self.output[index], opened["_text"]
        if opened["type"] == "function_call":
            status = "incomplete" if item["status"] == "incomplete" else "completed"
            item.update(status=status, arguments=text)
            events = [self._event("response.function_call_arguments.done",
                                  item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=text)]
        elif opened["type"] == "message":
            logprobs = opened["_logprobs"]
            part = _output_text(text, logprobs)
            item.update(status="completed", content=[part])
            events = [
                self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=text,
                            logprobs=list(logprobs)),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part)]
        else:
            status = "incomplete" if item["status"] == "incomplete" else "completed"
            item.update(status=status, content=[{"type": "reasoning_text", "text": text}])
            events = [self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=text)]
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item)))
        return events

    def _take_logprobs(self) -> list[dict[str, Any]]:
        """The waiting tokens' logprobs as OpenAI's entries (none when not asked for)."""
        pending, self._pending = self._pending, []
        if self._token_text is None or not pending:
            return []
        converted = openai_logprobs(pending, self._token_text)
        assert converted is not None  # (None only for logprobs never asked for)
        return list(converted["content"])

    def _call_delta(self, delta: ToolCallDelta) -> list[Event]:
        """A tool call's piece: its first opens a function_call item, arguments stream in."""
        events: list[Event] = []
        if delta.id is not None:  # a new call: the item before it is done
            events += self._close_open()
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": delta.id, "name": delta.name or "", "arguments": ""}
            self.output.append(item)
            self._open = {"type": "function_call", "id": item["id"], "_text": ""}
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=dict(item)))
        assert self._open is not None and self._open["type"] == "function_call"
        if delta.arguments:
            self._open["_text"] += delta.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open["id"],
                                      output_index=len(self.output) - 1,
                                      delta=delta.arguments))
        return events

    def _end(self, usage: Usage, finish: FinishReason,
             completion: Completion | None) -> list[Event]:
        cut = {c.id for c in completion.invalid_tool_calls if c.index is not None} if (
            completion is not None) else set()
        if self._open is not None and self._open["type"] == "function_call" and (
                self.output[-1]["call_id"] in cut):
            self.output[-1]["status"] = "incomplete"  # cut by the row's end: sent as written
        if (self._open is not None and self._open["type"] == "reasoning"
                and finish is FinishReason.LENGTH):
            self.output[-1]["status"] = "incomplete"  # max_output_tokens cut the thinking
        events = self._close_open()
        self.usage = usage_of(usage)
        if finish is FinishReason.LENGTH:
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.response()))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", response=self.response()))
        return events


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": list(logprobs or ())}
