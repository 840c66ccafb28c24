"""A request as the engine thread tracks it, and how its tokens become events.

``Row`` owns everything per request that is not device work: the text state (stop
strings, channels), ids, logprobs, timings; it turns tokens into ``StreamEvent``s and
builds the final ``Completion``. The engine decides when rows start, stop and leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.channels import RowChannels
from engine.request import (
    Completion,
    FinishReason,
    Prompt,
    SamplingParams,
    StreamEvent,
    TokenCallback,
    TokenLogprob,
    Usage,
)
from engine.streams import RequestStream
from engine.text import RowText
from engine.tools import ToolSpec


@dataclass
class Row:
    """A request the engine thread knows about, from submit to its final event."""

    request_id: int
    prompt: Prompt
    params: SamplingParams
    stream: RequestStream
    on_token: TokenCallback | None
    submitted_at: float
    deadline: float | None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    head_len: int = 0
    cached_tokens: int = 0
    text: RowText | None = None
    channels: RowChannels | None = None
    stop_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancel_error: BaseException | None = None
    queued: bool = False  # waiting for admission
    admitted: bool = False  # holds a row in the batch or the serial lane

    def take_token(self, token: int, finish: FinishReason | None, now: float) -> tuple[
            str, tuple[int, ...], FinishReason | None]:
        """Record a generated token: (visible text delta, new ids, finish reason so far).

        A stop token ends the row without becoming text; a stop string ends it too.
        """
        assert self.text is not None
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.completion_tokens += 1
        if finish is FinishReason.STOP and token in self.stop_ids:
            return "", (), finish
        self.token_ids.append(token)
        delta = self.text.add_token(token)
        return delta, (token,), FinishReason.STOP if self.text.stopped else finish

    def event(self, delta: str, ids: tuple[int, ...],
              logprobs: tuple[TokenLogprob, ...] | None) -> StreamEvent:
        """A non-final event, with the delta split into content and reasoning."""
        assert self.channels is not None
        content, reasoning = self.channels.feed(delta)
        return StreamEvent(delta, ids, logprobs, content=content, reasoning=reasoning)

    def final(self, reason: FinishReason, error: BaseException | None, delta: str,
              ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] | None) -> tuple[
            StreamEvent, Completion]:
        """The last event and the whole completion; held-back text is released here."""
        if self.text is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            delta += self.text.finish()
        channels = self.channels
        content = reasoning = ""
        if channels is not None:
            fed, flushed = channels.feed(delta), channels.finish()
            content, reasoning = fed[0] + flushed[0], fed[1] + flushed[1]
        usage = self.usage()
        completion = Completion(
            text=self.text.text if self.text is not None else "",
            token_ids=tuple(self.token_ids),
            finish_reason=reason,
            usage=usage,
            logprobs=tuple(self.logprobs) if self.params.logprobs else None,
            content=channels.content if channels is not None else "",
            reasoning=channels.reasoning if channels and channels.saw_reasoning else None,
            tool_calls=tuple(channels.calls) if channels is not None else (),
            invalid_tool_calls=tuple(channels.invalid) if channels is not None else (),
        )
        event = StreamEvent(delta, ids, logprobs, reason, usage, error, content, reasoning,
                            completion)
        return event, completion

    def usage(self) -> Usage:
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        rate = None
        if self.first_token_at is not None and self.last_token_at is not None:
            span = self.last_token_at - self.first_token_at
            if self.completion_tokens > 1 and span > 0:
                rate = (self.completion_tokens - 1) / span
        return Usage(len(self.prompt_ids), self.completion_tokens, self.cached_tokens, ttft, rate)
