"""The one place that decides how a row ends, from what a lane step produced (no mlx).

Every way a row can end is decided here, in this precedence: its own code failed
(a processor or its grammar) -> error; a stop token -> stop; a stop string -> stop;
``max_tokens`` reached -> length; its grammar complete -> stop; it closed a tool call
identical to one it already made -> stop (the repeat is dropped: greedy models loop on a
forced call); its ``on_token`` callback returned False -> stop, or raised -> error. A stop
whose answer holds tool calls is reported as ``tool_calls``. Cancellation and timeouts
are the scheduler's; model failures the loop's. Pure: testable with hand-built rows and
steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.core.lane import LaneStep, RowToken
from engine.core.rows import RequestStatus, Row
from engine.requests.outbound.results import FinishReason, StreamEvent, TokenLogprob


@dataclass(frozen=True)
class Ending:
    """A row that ends at this step, with what its final event carries."""

    row: Row
    reason: FinishReason
    error: BaseException | None = None
    delta: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class StepOutcome:
    """What a step means for its rows: events to publish, rows that end."""

    events: list[tuple[Row, StreamEvent]] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)
    tokens: int = 0
    forced: int = 0  # of ``tokens``, forced by a grammar (fast-forward)
    drafted: int = 0  # of ``tokens``, speculative drafts the model confirmed


def update(rows: Mapping[int, Row], step: LaneStep, now: float) -> StepOutcome:
    """Apply one lane step to the rows it names; rows already gone are skipped."""
    outcome = StepOutcome()
    for request_id, error in step.failed.items():
        row = rows.get(request_id)
        if row is not None:
            outcome.endings.append(Ending(row, FinishReason.ERROR, error))
    for request_id, cached in step.cached_tokens.items():
        row = rows.get(request_id)
        if row is not None:
            row.cached_tokens = cached
    ended: set[int] = set()  # a row may bring several tokens; those after its end are dropped
    for token in step.tokens:
        row = rows.get(token.request_id)
        if row is None or token.request_id in step.failed or token.request_id in ended:
            continue
        outcome.tokens += 1
        outcome.forced += token.forced
        outcome.drafted += token.drafted
        ending = take_token(row, token, now)
        if ending is None:
            continue
        if isinstance(ending, Ending):
            ended.add(token.request_id)
            outcome.endings.append(ending)
        else:
            outcome.events.append((row, ending))
    return outcome


def take_token(row: Row, out: RowToken, now: float) -> Ending | StreamEvent | None:
    """Record one token: an event to stream, the row's ending, or None (nothing to say)."""
    assert row.text is not None and row.prepared is not None
    row.status = RequestStatus.DECODING
    row.first_token_at = row.first_token_at or now
    row.last_token_at = now
    row.completion_tokens += 1
    token = out.token
    reason: FinishReason | None = None
    delta = ""
    ids: tuple[int, ...] = ()
    if token in row.prepared.stop_ids:
        reason = FinishReason.STOP  # a stop token ends the row without becoming text
    else:
        row.token_ids.append(token)
        delta, ids = row.text.add_token(token), (token,)
        if out.logprob is not None:
            row.logprobs.append(out.logprob)
        if row.text.stopped:
            reason = FinishReason.STOP
        elif row.completion_tokens >= row.params.max_tokens:
            reason = FinishReason.LENGTH
        elif out.grammar_done:
            reason = FinishReason.STOP  # the grammar is complete: nothing may follow
    repeats = row.repeated_calls
    thinking = row.thinking
    row.take_text(delta)  # calls are parsed as their closing markers arrive
    if ids and thinking and row.thinking:  # inside the block, not a marker that left it
        row.reasoning_tokens += 1
    if reason is None and row.repeated_calls > repeats:
        reason = FinishReason.STOP  # the call just closed repeats an earlier one
    if row.on_token is not None:
        try:
            if row.on_token(token, delta) is False and reason is None:
                reason = FinishReason.STOP
        except Exception as exc:  # fails this row's consumer only
            return Ending(row, FinishReason.ERROR, exc)
    logprobs: tuple[TokenLogprob, ...] | None = None
    if out.logprob is not None:  # asked for; a stop token is no output, so, like its
        # text, its logprob is in neither the event nor the completion: a stream's
        # logprobs add up to the completion's.
        logprobs = (out.logprob,) if ids else ()
    if reason is None:
        return row.event(delta, ids, logprobs)
    tail = row.text.finish()  # text held back for stop strings is real output now
    row.take_text(tail)
    if reason is FinishReason.STOP and row.has_calls:
        reason = FinishReason.TOOL_CALLS
    return Ending(row, reason, None, delta + tail, ids, logprobs)
