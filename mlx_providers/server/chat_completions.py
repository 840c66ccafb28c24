"""Chat-completions output: a whole ``chat.completion``, or its ``chat.completion.chunk``s.

Content and reasoning stream as they are generated. Reasoning goes out under two keys
with the same text, ``reasoning_content`` (vLLM's and mlx-lm's servers' name) and
``reasoning`` (OpenRouter's and newer vLLM's; LlamaIndex's OpenAI clients read either), in
the whole message and in every delta; usage counts it in
``completion_tokens_details.reasoning_tokens``. Tool calls stream as the engine's
``tool_call_deltas`` (index, id and name on a call's first delta, then ``arguments``
fragments as the model writes them); the engine holds back a call it may still drop, so a
client's accumulated kept calls equal the non-streamed ones (a call cut by max_tokens was
sent as far as it was written, as OpenAI does, and the finish reason is ``length``).
``ChatAnswer`` is this endpoint's side of the shared generation flow.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine import (
    Completion,
    FinishReason,
    StreamEvent,
    TokenText,
    ToolCall,
    ToolCallDelta,
    Usage,
    openai_logprobs,
)
from mlx_providers.server.errors import from_engine


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
            "prompt_tokens_details": {"cached_tokens": counts["cached_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": counts["reasoning_tokens"]}}


def reasoning_fields(text: str) -> dict[str, str]:
    """Reasoning text under both keys clients read it from."""
    return {"reasoning_content": text, "reasoning": text}


def tool_call_dicts(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": call.arguments_text}} for call in calls]


def tool_call_delta_dict(delta: ToolCallDelta) -> dict[str, Any]:
    """One ``delta.tool_calls`` entry as OpenAI streams it (id and name on the first)."""
    out: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {}
    if delta.id is not None:
        out.update(id=delta.id, type="function")
    if delta.name is not None:
        function["name"] = delta.name
    function["arguments"] = delta.arguments
    out["function"] = function
    return out


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
            message.update(reasoning_fields(completion.reasoning))
        choice = {"index": 0, "message": message,
                  "logprobs": openai_logprobs(completion.logprobs, self._token_text)
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
        logprobs = (openai_logprobs(event.logprobs, self._token_text)
                    if self._logprobs and event.logprobs else None)
        if event.reasoning:
            chunks.append(self.chunk(reasoning_fields(event.reasoning)))
        if event.content or logprobs:
            chunks.append(self.chunk({"content": event.content}, logprobs=logprobs))
        for delta in event.tool_call_deltas:  # call pieces written at this step
            chunks.append(self.chunk({"tool_calls": [tool_call_delta_dict(delta)]}))
        if not event.is_final:
            return chunks
        completion = event.completion
        assert completion is not None and event.finish_reason is not None
        chunks.append(self.chunk({}, finish=finish_reason(event.finish_reason)))
        if self._include_usage:
            chunks.append({**self.chunk({}), "choices": [],
                           "usage": usage_dict(completion.usage)})
        return chunks


class ChatAnswer:
    """Chat completions' side of ``generation.serve``: SSE data lines, or the whole body."""

    def __init__(self, shaper: ChatCompletionShaper) -> None:
        self.shaper = shaper
        self._completion: Completion | None = None

    def start(self) -> list[str]:
        return [data(self.shaper.first_chunk())]

    def feed(self, event: StreamEvent) -> list[str]:
        if event.completion is not None:
            self._completion = event.completion
        return [data(chunk) for chunk in self.shaper.event_chunks(event)]

    def fail(self, error: BaseException) -> list[str]:
        return [data(from_engine(error).body())]  # OpenAI's error object, then the end

    def end(self) -> list[str]:
        return ["[DONE]"]

    def body(self) -> dict[str, Any]:
        assert self._completion is not None, "the final event was not fed"
        return self.shaper.completion(self._completion)

    def close(self, outcome: str) -> None:
        """Nothing to keep: chat completions are not stored."""


def data(value: dict[str, Any]) -> str:
    """One SSE ``data:`` payload: compact JSON."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
