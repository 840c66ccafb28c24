"""Ollama's answers, built from the engine's events: NDJSON chunks, or one whole object.

``/api/chat``'s objects carry a ``message`` (``role``, ``content``, ``thinking``,
``tool_calls``), ``/api/generate``'s a ``response`` string (and ``thinking``). Each chunk
is ``{"model", "created_at", ..., "done": false}``; the last is ``done: true`` with
``done_reason`` (``stop`` or ``length``) and Ollama's figures: ``total_duration``,
``load_duration`` (the reload this request waited for, if keep_alive had unloaded the
model), ``prompt_eval_count``/``_duration`` (the prompt's tokens, the time to the first
token), ``eval_count``/``_duration`` (the generated tokens, first to last), nanoseconds.

Tool calls go out whole, with their arguments as an object, as Ollama sends them: in a
chunk of their own just before the last (the engine knows a call is kept only when the
row ends), and in the whole answer's message. Every chunk's message has ``content``,
``""`` when it carries none: LlamaIndex's client skips a chunk without it. Logprobs, when
asked for, are each chunk's tokens' (``logprobs``: ``token``, ``logprob``, ``bytes``,
``top_logprobs``), the same numbers as the OpenAI doors' (``engine.openai_logprobs``).
``OllamaAnswer`` is this door's side of the shared generation flow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal

from engine import (
    Completion,
    Engine,
    FinishReason,
    StreamEvent,
    TokenLogprob,
    TokenText,
    ToolCall,
    Usage,
    openai_logprobs,
)
from mlx_providers.server.ollama_errors import error_body
from mlx_providers.server.ollama_stream import line

Kind = Literal["chat", "generate"]


def created_at() -> str:
    """Now as Ollama writes it: RFC 3339 in UTC, microseconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


def done_reason(reason: FinishReason) -> str:
    """Ollama's: ``length`` when the token limit cut it, else ``stop`` (calls too)."""
    return "length" if reason == FinishReason.LENGTH else "stop"


def tool_call_dicts(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls as Ollama writes them: ``function.arguments`` an object, ``function.index``."""
    return [{"id": call.id, "function": {"index": i, "name": call.name,
                                         "arguments": call.arguments}}
            for i, call in enumerate(calls)]


class Timing:
    """One request's clock and the engine figures its last chunk reports."""

    def __init__(self, engine: Engine) -> None:
        self.received = time.monotonic()
        self._engine = engine
        self._loads = engine.stats().loads  # a load after this one was this request's wait
        self._first: float | None = None

    def saw_tokens(self) -> None:
        if self._first is None:
            self._first = time.monotonic()

    def durations(self) -> dict[str, int]:
        """The request's total time and the model load it waited for (ns)."""
        stats = self._engine.stats()
        load = stats.last_load_seconds if stats.loads > self._loads else 0.0
        return {"total_duration": nanoseconds(time.monotonic() - self.received),
                "load_duration": nanoseconds(load)}

    def figures(self, usage: Usage) -> dict[str, int]:
        """Ollama's counts and durations (ns) for a finished request."""
        now = time.monotonic()
        to_first = usage.time_to_first_token
        if to_first is None:
            to_first = (self._first or now) - self.received
        rate = usage.decode_tokens_per_second
        decoding = ((usage.completion_tokens - 1) / rate if rate else
                    now - (self._first or now))
        return {**self.durations(),
                "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": nanoseconds(to_first),
                "eval_count": usage.completion_tokens,
                # Clients divide by it (tokens per second): never 0.
                "eval_duration": max(nanoseconds(decoding), 1)}


class OllamaAnswer:
    """Ollama's side of ``generation.serve``: NDJSON lines, or the whole object."""

    def __init__(self, kind: Kind, model: str, timing: Timing, *,
                 token_text: TokenText | None = None) -> None:
        """``model``: the name as the client sent it (Ollama echoes it); ``token_text``:
        how a token id reads, when logprobs were asked for (else None)."""
        self.kind = kind
        self.model = model
        self.timing = timing
        self._token_text = token_text
        self._completion: Completion | None = None

    def _object(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at(), **fields}

    def _text(self, content: str, reasoning: str | None,
              calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        """The text fields of a chunk (or the whole answer) for this endpoint."""
        if self.kind == "generate":
            return {"response": content, **({"thinking": reasoning} if reasoning else {})}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = tool_call_dicts(calls)
        return {"message": message}

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        if self._token_text is None or logprobs is None:
            return {}
        converted = openai_logprobs(logprobs, self._token_text)
        return {"logprobs": converted["content"] if converted else []}

    def _done(self, completion: Completion) -> dict[str, Any]:
        return {"done": True, "done_reason": done_reason(completion.finish_reason),
                **self.timing.figures(completion.usage)}

    # ----- generation.Answer -----------------------------------------------------------

    def start(self) -> list[str]:
        return []  # Ollama sends nothing before the first token

    def feed(self, event: StreamEvent) -> list[str]:
        lines: list[str] = []
        if event.content or event.reasoning or event.logprobs:
            self.timing.saw_tokens()
            lines.append(line(self._object(**self._text(event.content, event.reasoning),
                                           done=False, **self._logprobs(event.logprobs))))
        if not event.is_final:
            return lines
        completion = event.completion
        assert completion is not None
        self._completion = completion
        if self.kind == "chat" and completion.tool_calls:
            lines.append(line(self._object(**self._text("", None, completion.tool_calls),
                                           done=False)))
        lines.append(line(self._object(**self._text("", None), **self._done(completion))))
        return lines

    def fail(self, error: BaseException) -> list[str]:
        """A failed generation's line: the ``ollama`` client raises it as a ResponseError."""
        return [line(error_body(f"generation failed: {error}"))]

    def end(self) -> list[str]:
        return []

    def body(self) -> dict[str, Any]:
        completion = self._completion
        assert completion is not None, "the final event was not fed"
        return self._object(**self._text(completion.content, completion.reasoning,
                                         completion.tool_calls),
                            **self._done(completion), **self._logprobs(completion.logprobs))

    def close(self, outcome: str) -> None:
        """Nothing to keep: Ollama's answers are not stored."""
