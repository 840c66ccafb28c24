"""A request as the engine thread tracks it, and how its tokens become events.

``Row`` owns everything per request that is not device work: its status, the text
state (stop strings, channels), ids, logprobs, timings; it turns tokens into
``StreamEvent``s and builds the final ``Completion``. ``engine.update`` decides when a
row ends; the loop decides when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.channels import RowChannels
from engine.prepare import PreparedRequest, RequestSpec
from engine.request import (
    Completion,
    FinishReason,
    RequestStatus,
    SamplingParams,
    StreamEvent,
    TokenCallback,
    TokenLogprob,
    Usage,
)
from engine.scheduler import LaneKind
from engine.streams import RequestStream
from engine.text import RowText


@dataclass
class Row:
    """A request the engine thread knows about, from submit to its final event."""

    request_id: int
    spec: RequestSpec
    stream: RequestStream
    on_token: TokenCallback | None
    submitted_at: float
    deadline: float | None
    status: RequestStatus = RequestStatus.WAITING
    lane: LaneKind | None = None  # set at admission
    finish_reason: FinishReason | None = None
    prepared: PreparedRequest | None = None
    text: RowText | None = None
    channels: RowChannels | None = None
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancel_error: BaseException | None = None  # why a cancel happened (a timeout)

    @property
    def params(self) -> SamplingParams:
        return self.prepared.params if self.prepared is not None else self.spec.params

    @property
    def holds_lane(self) -> bool:
        return self.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)

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
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
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
        prompt_tokens = len(self.prepared.prompt_ids) if self.prepared is not None else 0
        return Usage(prompt_tokens, self.completion_tokens, self.cached_tokens, ttft, rate)
