"""A request as the engine thread tracks it, and how its tokens become events.

``Row`` owns everything per request that is not device work: its status, the text
state (stop strings, channels), ids, logprobs, timings; it turns tokens into
``StreamEvent``s and builds the final ``Completion``. ``engine.core.update`` decides when a
row ends; the loop decides when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.core.lane import LaneKind
from engine.core.streams import RequestStream
from engine.requests.inbound.sampling import SamplingParams, TokenCallback
from engine.requests.inbound.text_request import Request
from engine.requests.outbound.results import (
    Completion,
    FinishReason,
    StreamEvent,
    TokenLogprob,
    Usage,
    truncation,
)
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText
from engine.requests.outbound.tool_calls import ToolCallDelta
from engine.requests.prepare import PreparedRequest


class RequestStatus(str, Enum):
    """Where a request is on the engine thread; FINISHED rows carry a ``FinishReason``."""

    WAITING = "waiting"  # accepted, not admitted yet (no KV memory held)
    PREFILLING = "prefilling"  # admitted to a lane, no token generated yet
    DECODING = "decoding"  # generating tokens
    FINISHED = "finished"


@dataclass
class Row:
    """A request the engine thread knows about, from submit to its final event."""

    request_id: int
    request: Request
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
    reasoning_tokens: int = 0  # of completion_tokens, inside the reasoning block
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancel_error: BaseException | None = None  # why a cancel happened (a timeout)
    # Characters of the channels' content and reasoning already sent in events.
    _sent_content: int = field(default=0, init=False, repr=False)
    _sent_reasoning: int = field(default=0, init=False, repr=False)

    @property
    def params(self) -> SamplingParams:
        return self.prepared.params if self.prepared is not None else self.request.params

    @property
    def holds_lane(self) -> bool:
        return self.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)

    @property
    def repeated_calls(self) -> int:
        """Tool calls dropped so far because this row had made each one already."""
        return self.channels.repeated_calls if self.channels is not None else 0

    @property
    def has_calls(self) -> bool:
        return bool(self.channels is not None and self.channels.calls)

    @property
    def thinking(self) -> bool:
        """Whether the row's output is inside its reasoning block now."""
        return self.channels is not None and self.channels.in_reasoning

    def take_text(self, delta: str) -> None:
        """Sort new text into the row's channels (``engine.core.update`` feeds every delta)."""
        if self.channels is not None and delta:
            self.channels.feed(delta)

    def event(self, delta: str, ids: tuple[int, ...],
              logprobs: tuple[TokenLogprob, ...] | None) -> StreamEvent:
        """A non-final event: the raw delta, and the content and reasoning not yet sent."""
        content, reasoning = self._unsent()
        return StreamEvent(delta, ids, logprobs, content=content, reasoning=reasoning,
                           tool_call_deltas=self._calls_unsent())

    def final(self, reason: FinishReason, error: BaseException | None, delta: str,
              ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] | None) -> tuple[
            StreamEvent, Completion]:
        """The last event and the whole completion; held-back channel text is released.

        ``delta`` has been through ``take_text`` already (``engine.core.update`` releases the
        text held back for stop strings when it ends a row); endings made elsewhere
        (errors, cancellation) carry no text.
        """
        channels = self.channels
        if channels is not None:
            channels.finish()
            if reason is FinishReason.STOP and channels.calls:
                # A call that only the row's end closed: harmony's <|call|> is a stop token.
                reason = FinishReason.TOOL_CALLS
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        content, reasoning = self._unsent()
        usage = self.usage()
        calls = tuple(channels.calls) if channels is not None else ()
        invalid = tuple(channels.invalid) if channels is not None else ()
        answer = channels.content if channels is not None else ""
        forces_call = self.prepared is not None and self.prepared.forces_call
        completion = Completion(
            text=self.text.text if self.text is not None else "",
            token_ids=tuple(self.token_ids),
            finish_reason=reason,
            usage=usage,
            logprobs=tuple(self.logprobs) if self.params.logprobs else None,
            content=answer,
            reasoning=channels.reasoning if channels and channels.saw_reasoning else None,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            truncated=truncation(reason, forces_call, self.params.constraint, answer,
                                 len(calls), len(invalid)),
        )
        event = StreamEvent(delta, ids, logprobs, reason, usage, error, content, reasoning,
                            completion, self._calls_unsent())
        return event, completion

    def _unsent(self) -> tuple[str, str]:
        """Content and reasoning the channels produced since the last event."""
        if self.channels is None:
            return "", ""
        content = self.channels.content[self._sent_content:]
        reasoning = self.channels.reasoning[self._sent_reasoning:]
        self._sent_content += len(content)
        self._sent_reasoning += len(reasoning)
        return content, reasoning

    def _calls_unsent(self) -> tuple[ToolCallDelta, ...]:
        """Pieces of the tool calls kept since the last event (carried by the next event)."""
        return self.channels.take_deltas() if self.channels is not None else ()

    def usage(self) -> Usage:
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        rate = None
        if self.first_token_at is not None and self.last_token_at is not None:
            span = self.last_token_at - self.first_token_at
            if self.completion_tokens > 1 and span > 0:
                rate = (self.completion_tokens - 1) / span
        prompt_tokens = len(self.prepared.prompt_ids) if self.prepared is not None else 0
        return Usage(prompt_tokens, self.completion_tokens, self.cached_tokens, ttft, rate,
                     self.reasoning_tokens)
