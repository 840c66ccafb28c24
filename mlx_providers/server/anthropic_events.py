"""Anthropic ``Message`` objects and stream events, translated from the engine's events.

``MessageTranslator`` reads the ``engine.StreamEvent``s of one generation and produces the
Messages API's event sequence: ``message_start`` (the message with empty content, its
usage counting the prompt), ``ping``, then per content block ``content_block_start``, its
deltas (``thinking_delta`` for the engine's reasoning, ``text_delta`` for its content,
``input_json_delta`` for a tool call's arguments as the model writes them) and
``content_block_stop``; last ``message_delta`` (``stop_reason``, ``stop_sequence``, the
whole usage) and ``message_stop``. The non-streaming endpoint runs the same translator and
returns its message, so both paths produce the same blocks.

Blocks follow the order the engine wrote them in: reasoning, text and calls each open a
new block when the kind changes. A tool call the engine may still drop is held back by the
engine, so every ``tool_use`` block sent is one the engine kept, except a call cut by
``max_tokens``: streamed as far as it was written (``stop_reason`` ``max_tokens``), left
out of the whole message, as chat completions do. A ``tool_use`` block's ``input`` is the
engine's parsed arguments.

Usage is Anthropic's: ``input_tokens`` are the prompt tokens the prefix cache did not
supply and ``cache_read_input_tokens`` those it did (their sum is the prompt), and
``output_tokens_details.thinking_tokens`` the reasoning tokens as the engine counts them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
from mlx_providers.server.anthropic_errors import engine_error
from mlx_providers.server.chat_completions import new_id

Event = dict[str, Any]


def usage_of(usage: Usage) -> dict[str, Any]:
    """Anthropic's usage from the engine's: the prompt split into what the prefix cache
    supplied (``cache_read_input_tokens``) and the rest (``input_tokens``)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"thinking_tokens": usage.reasoning_tokens}}


def matched_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop sequence that ended ``text`` (the row's tokens decoded): the one found
    first, as the engine's stop matching finds it. The engine ends a row on its first
    stop string and says only ``stop``; Anthropic's clients are told which."""
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    return min(found)[1] if found else None


class MessageTranslator:
    """One message's state: its content blocks so far, and the events that built them."""

    def __init__(self, model: str, *, stop_sequences: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None,
                 token_text: TokenText | None = None) -> None:
        """``decode``: the tokenizer's, to tell which stop sequence ended the row (read
        only then); ``token_text``: how a token id reads, when logprobs were asked for."""
        self.id = new_id("msg_")
        self.model = model
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] | None = None
        # The prompt's tokens for message_start (counted while the row prefills); the
        # final usage, in message_delta, has the split by the prefix cache.
        self.input_tokens: int | None = None
        self._stops = tuple(stop_sequences)
        self._decode = decode
        self._token_text = token_text
        self._logprobs: list[TokenLogprob] = []
        self._open: str | None = None  # the type of the last block while it takes deltas
        self._cut: set[str] = set()  # ids of calls max_tokens cut (sent, not in the message)

    # ----- the message object --------------------------------------------------------

    def message(self) -> dict[str, Any]:
        """The ``message``: its blocks so far (the whole message once it ended)."""
        content = [{k: v for k, v in block.items() if not k.startswith("_")}
                   for block in self.content
                   if block["type"] != "tool_use" or block["id"] not in self._cut]
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": content, "stop_reason": self.stop_reason,
               "stop_sequence": self.stop_sequence,
               "usage": self.usage if self.usage is not None else self._start_usage()}
        if self._token_text is not None:
            out["logprobs"] = self._all_logprobs()
        return out

    def _start_usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens or 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0, "output_tokens": 0}

    # ----- events ----------------------------------------------------------------------

    def start(self) -> list[Event]:
        """``message_start`` with the empty message, then a ``ping`` (as Anthropic sends)."""
        start = {**self.message(), "content": []}
        start.pop("logprobs", None)
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def feed(self, event: StreamEvent) -> list[Event]:
        """The events one engine event becomes (the final one ends the message)."""
        events: list[Event] = []
        if self._token_text is not None:
            self._logprobs += event.logprobs or ()
        if event.reasoning:
            events += self._text("thinking", event.reasoning)
        if event.content:
            events += self._text("text", event.content)
        for delta in event.tool_call_deltas:
            events += self._call(delta)
        if event.is_final and event.error is None:
            assert event.finish_reason is not None and event.usage is not None
            events += self._end(event.finish_reason, event.usage, event.completion)
        return events

    def fail(self, error: BaseException) -> list[Event]:
        """Generation failed mid-stream: Anthropic's ``error`` event (the stream ends)."""
        return [engine_error(error).body()]

    # ----- blocks ----------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open != kind:
            events += self._close()
            block = ({"type": "text", "text": ""} if kind == "text" else
                     {"type": "thinking", "thinking": "", "signature": ""})
            events += self._start_block(block)
        self.content[-1][kind] += text
        delta = ({"type": "text_delta", "text": text} if kind == "text" else
                 {"type": "thinking_delta", "thinking": text})
        events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                       "delta": delta})
        return events

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        """A tool call's piece: its first opens a ``tool_use`` block, arguments stream in
        as ``input_json_delta`` (their text concatenates to the call's JSON)."""
        events: list[Event] = []
        if delta.id is not None:
            events += self._close()
            events += self._start_block({"type": "tool_use", "id": delta.id,
                                         "name": delta.name or "", "input": {}})
            self.content[-1]["_json"] = ""
        if delta.arguments and self._open == "tool_use":
            self.content[-1]["_json"] += delta.arguments
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": delta.arguments}})
        return events

    def _start_block(self, block: dict[str, Any]) -> list[Event]:
        self.content.append(block)
        self._open = block["type"]
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        block = self.content[-1]
        if self._open == "tool_use":
            block["input"] = _arguments(block.pop("_json"))
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _end(self, finish: FinishReason, usage: Usage,
             completion: Completion | None) -> list[Event]:
        events = self._close()
        if completion is not None:
            kept = {call.id: call.arguments for call in completion.tool_calls}
            for block in self.content:  # the engine's parse of each kept call
                if block["type"] == "tool_use" and block["id"] in kept:
                    block["input"] = dict(kept[block["id"]])
            self._cut = {call.id for call in completion.invalid_tool_calls}
        self.stop_reason, self.stop_sequence = self._stop_reason(finish, completion)
        self.usage = usage_of(usage)
        delta: Event = {"type": "message_delta",
                        "delta": {"stop_reason": self.stop_reason,
                                  "stop_sequence": self.stop_sequence},
                        "usage": self.usage}
        if self._token_text is not None:  # this server's: every generated token's
            delta["logprobs"] = self._all_logprobs()
        return [*events, delta, {"type": "message_stop"}]

    def _stop_reason(self, finish: FinishReason,
                     completion: Completion | None) -> tuple[str, str | None]:
        if finish is FinishReason.TOOL_CALLS:
            return "tool_use", None
        if finish is FinishReason.LENGTH:
            return "max_tokens", None
        if self._stops and self._decode is not None and completion is not None:
            stop = matched_stop(self._decode(list(completion.token_ids)), self._stops)
            if stop is not None:
                return "stop_sequence", stop
        return "end_turn", None

    def _all_logprobs(self) -> dict[str, Any] | None:
        """Logprobs in OpenAI's shape (``engine.openai_logprobs``), as chat completions."""
        assert self._token_text is not None
        return openai_logprobs(self._logprobs, self._token_text)


def _arguments(text: str) -> dict[str, Any]:
    """A streamed call's arguments as an object (a cut call's text may not parse: its
    block is left out of the whole message, and the stream sent it as written)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
