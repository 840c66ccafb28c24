"""Chat-completions output: a whole ``chat.completion``, or its ``chat.completion.chunk``s.

Content and reasoning stream as they are generated (reasoning as ``reasoning_content``
deltas, as vLLM and mlx-lm servers do); tool calls are parsed by the engine when the row
ends, so each call is sent once, whole, in one delta with its final id. The Responses
stream is built from these same chunks (``responses_events``), so both endpoints tell the
same story.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from engine import Completion, FinishReason, StreamEvent, TokenLogprob, ToolCall, Usage

TokenText = Callable[[int], str]  # token id -> its text (for logprobs)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish reasons; a cancelled row is only ever seen by nobody."""
    return {FinishReason.TOOL_CALLS: "tool_calls", FinishReason.LENGTH: "length"}.get(
        reason, "stop")


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object: the engine's usage (``Usage.as_dict``), renamed and nested."""
    counts = usage.as_dict()
    return {"prompt_tokens": counts["prompt_tokens"],
            "completion_tokens": counts["completion_tokens"],
            "total_tokens": counts["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": counts["cached_tokens"]}}


def tool_call_dicts(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
        for call in calls]


def logprobs_dict(logprobs: Sequence[TokenLogprob] | None,
                  token_text: TokenText) -> dict[str, Any] | None:
    """OpenAI's ``logprobs.content`` for some tokens (None when none were asked for)."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob),
         "top_logprobs": [entry(tid, value) for tid, value in lp.top]}
        for lp in logprobs]}


class ChatCompletionShaper:
    """Builds one request's response objects; ids and ``created`` are fixed per request."""

    def __init__(self, model: str, token_text: TokenText, *, include_usage: bool = False,
                 logprobs: bool = False) -> None:
        self.id = new_id("chatcmpl-")
        self.created = int(time.time())
        self.model = model
        self._token_text = token_text
        self._include_usage = include_usage
        self._logprobs = logprobs

    def completion(self, completion: Completion) -> dict[str, Any]:
        """The non-streaming ``chat.completion``."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": completion.content or None}
        if completion.tool_calls:
            message["tool_calls"] = tool_call_dicts(completion.tool_calls)
        elif message["content"] is None:
            message["content"] = ""
        if completion.reasoning:
            message["reasoning_content"] = completion.reasoning
        choice = {"index": 0, "message": message,
                  "logprobs": logprobs_dict(completion.logprobs, self._token_text)
                  if self._logprobs else None,
                  "finish_reason": finish_reason(completion.finish_reason)}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [choice],
                "usage": usage_dict(completion.usage)}

    def chunk(self, delta: dict[str, Any], *, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}
        if self._include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def first_chunk(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def event_chunks(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The chunks one engine event becomes (the final event adds calls, finish, usage)."""
        chunks: list[dict[str, Any]] = []
        logprobs = (logprobs_dict(event.logprobs, self._token_text)
                    if self._logprobs and event.logprobs else None)
        if event.reasoning:
            chunks.append(self.chunk({"reasoning_content": event.reasoning}))
        if event.content or logprobs:
            chunks.append(self.chunk({"content": event.content}, logprobs=logprobs))
        if not event.is_final:
            return chunks
        completion = event.completion
        assert completion is not None and event.finish_reason is not None
        for index, call in enumerate(tool_call_dicts(completion.tool_calls)):
            chunks.append(self.chunk({"tool_calls": [{"index": index, **call}]}))
        chunks.append(self.chunk({}, finish=finish_reason(event.finish_reason)))
        if self._include_usage:
            chunks.append({**self.chunk({}), "choices": [],
                           "usage": usage_dict(completion.usage)})
        return chunks
