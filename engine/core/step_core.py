"""The step core: the engine thread's work on rows, one turn at a time.

    plan    = scheduler.plan()          # cancellations first, then admissions
    step    = lane.step()               # the only device work (batch lane, serial lane)
    outcome = update(rows, step, now)   # every way a row ends is decided there
    publish                             # events to streams; the core never waits on one

The engine thread (engine/runtime/runtime.py, behind the public ``Engine``) owns the
command queue, loading, embeddings and the stats snapshot; it hands this core accepted rows
and cancellations and calls ``turn`` once per loop. Nothing here imports mlx: lanes are the
``Lane`` protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.lane import Lane, LaneKind, LaneRow
from engine.core.rows import RequestStatus, Row
from engine.core.scheduler import Scheduler, StepPlan, Ticket
from engine.core.stats import StatsBook
from engine.core.step_probe import StepProbe
from engine.core.update import Ending, update
from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestTimeoutError,
)
from engine.requests.outbound.results import FinishReason
from engine.requests.prepare import Preparer

log = logging.getLogger("engine")


@dataclass(frozen=True)
class Turn:
    """What one turn did: its seconds in lane steps, and the peak right after admission."""

    step_seconds: float
    # For a StepProbe's report only (empty without one): request ids started this turn,
    # batch lane first, in order, and the KV figures right after admission.
    admitted: tuple[int, ...] = ()
    kv_bytes_projected: int = 0
    prefix_bytes: int = 0


class StepCore:
    """Rows on the engine thread: accepted, planned, stepped, updated, published, ended."""

    def __init__(self, scheduler: Scheduler, lanes: Callable[[LaneKind], Lane],
                 preparer: Preparer, book: StatsBook, *, prefix_bytes: Callable[[], int],
                 max_consecutive_failures: int, probe: StepProbe | None = None) -> None:
        self.scheduler = scheduler
        self.preparer = preparer
        self.rows: dict[int, Row] = {}
        self.ended_since_collect = False  # rows ended since the engine last collected
        self._lanes = lanes
        self._book = book
        self._prefix_bytes = prefix_bytes
        self._max_failures = max_consecutive_failures
        self._consecutive_failures = 0
        self._probe = probe

    # ----- what the engine hands in -------------------------------------------------------

    def accept(self, row: Row) -> None:
        """Prepare a submitted request once; a request that cannot run fails alone."""
        self.rows[row.request_id] = row
        try:
            prepared = self.preparer.prepare(row.request)
            kv_bytes = self.scheduler.validate(len(prepared.prompt_ids),
                                               prepared.params.max_tokens)
            lane = self.scheduler.lane_for(prepared.params.needs_serial_lane)
        except Exception as exc:
            self.end(Ending(row, FinishReason.ERROR, exc))
            return
        row.prepared = prepared
        row.text = self.preparer.row_text(prepared.params)
        row.channels = self.preparer.row_channels(row.request, prepared)
        self.scheduler.enqueue(Ticket(row.request_id, len(prepared.prompt_ids),
                                      prepared.params.max_tokens, kv_bytes, lane))

    def cancel(self, request_id: int) -> None:
        """Cancel a row at the next plan (an id that already ended is ignored)."""
        if request_id in self.rows:
            self.scheduler.cancel(request_id)

    def deadlines(self) -> list[float]:
        """The rows' deadlines (monotonic seconds): the loop must wake for the nearest."""
        return [r.deadline for r in self.rows.values() if r.deadline is not None]

    # ----- one turn ------------------------------------------------------------------------

    def turn(self) -> Turn:
        """Expire deadlines, plan, step each lane that holds rows, publish their events."""
        self._expire_deadlines()
        plan = self.scheduler.plan()
        self._apply(plan)
        self.scheduler.fit_cache()  # rows evicted by the plan may have stored their KV
        peak = None
        if self._probe is not None:  # the turn's peak: right after admission, before any step
            peak = (tuple(t.request_id for kind in LaneKind for t in plan.admitted(kind)),
                    self.scheduler.kv_bytes_projected, self._prefix_bytes())
        stepping = 0.0
        for kind in LaneKind:
            lane = self._lanes(kind)
            if len(lane):
                stepping += self._step(kind, lane)
        self.scheduler.fit_cache()  # heads and finished rows may have been stored
        return Turn(stepping, *peak) if peak is not None else Turn(stepping)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for row in self.rows.values():
            if row.deadline is not None and row.deadline <= now and row.cancel_error is None:
                row.cancel_error = RequestTimeoutError(
                    f"request {row.request_id} timed out after "
                    f"{row.deadline - row.submitted_at:.3g} s"
                )
                self.scheduler.cancel(row.request_id)

    def _apply(self, plan: StepPlan) -> None:
        """Carry out the plan: drop and evict cancelled rows, start admitted ones."""
        if not plan:
            return
        cancelled = [self.rows[i] for i in (*plan.dropped, *plan.evict)]
        for kind in LaneKind:
            evicted = [r.request_id for r in cancelled if r.holds_lane and r.lane is kind]
            if evicted:
                self._lanes(kind).remove(evicted)
        for row in cancelled:
            self.end(Ending(row, FinishReason.CANCELLED, row.cancel_error))
        admitted = 0
        for kind in LaneKind:
            rows = [self.rows[t.request_id] for t in plan.admitted(kind)]
            if not rows:
                continue
            lane = self._lanes(kind)
            starting = [(row, _lane_row(row)) for row in rows]
            refused = [(row, reason) for row, lane_row in starting
                       if (reason := lane.accepts(lane_row)) is not None]
            if refused:  # what the lane's model cannot take fails alone, by name
                self._refuse(refused)
                gone = {row.request_id for row, _ in refused}
                starting = [(row, lane_row) for row, lane_row in starting
                            if row.request_id not in gone]
            for row, _ in starting:
                row.status, row.lane = RequestStatus.PREFILLING, kind
            if starting:
                lane.insert([lane_row for _, lane_row in starting])
                admitted += sum(len(row.prepared.prompt_ids) for row, _ in starting
                                if row.prepared is not None)
        self._book.add(prompt_tokens=admitted)

    def _refuse(self, refused: list[tuple[Row, str]]) -> None:
        """Admitted rows their lane cannot run end with an error naming why."""
        self.scheduler.finish([row.request_id for row, _ in refused])
        for row, reason in refused:
            field = "images" if "images" in reason else "adapter"
            self.end(Ending(row, FinishReason.ERROR, InvalidRequestError(reason, field)))

    def _step(self, kind: LaneKind, lane: Lane) -> float:
        """Step one lane, decide what its tokens mean, publish; returns the step's seconds."""
        started = time.perf_counter()
        try:
            if self._probe is not None:
                self._probe.before_step(kind.value)
            step = lane.step()
        except EngineDeadError:  # a sharded engine's rank failed: nothing to contain
            raise
        except Exception as exc:  # contained below, or fatal after retries
            self._model_failure(lane, exc)
            return time.perf_counter() - started
        seconds = time.perf_counter() - started
        self._consecutive_failures = 0
        outcome = update(self.rows, step, time.monotonic())
        self._book.stepped(seconds, step.width, outcome.tokens, outcome.forced,
                           outcome.drafted)
        for row, event in outcome.events:
            row.stream.publish(event)
        if outcome.endings:
            ended = [ending.row.request_id for ending in outcome.endings]
            lane.remove(ended)
            self.scheduler.finish(ended)
            for ending in outcome.endings:
                self.end(ending)
        return seconds

    def _model_failure(self, lane: Lane, exc: Exception) -> None:
        """A model step failed: fail the lane's rows, then recover or die."""
        log.error("model step failed: %r", exc)
        self._consecutive_failures += 1
        failed = lane.reset()
        self.scheduler.finish(failed)
        for request_id in failed:
            row = self.rows.get(request_id)
            if row is not None:
                error = EngineError(f"the model step failed: {exc!r}")
                error.__cause__ = exc
                self.end(Ending(row, FinishReason.ERROR, error))
        if self._consecutive_failures >= self._max_failures:
            raise EngineDeadError(
                f"{self._consecutive_failures} model steps failed in a row; last: {exc!r}"
            ) from exc

    # ----- endings -------------------------------------------------------------------------

    def end(self, ending: Ending) -> None:
        """A row's last event: the row leaves the engine, its consumer wakes last."""
        self.ended_since_collect = True
        self.rows.pop(ending.row.request_id, None)
        # The scheduler and the lane have let the row go (its grammar matcher closed): what
        # it held leaves the figures with it, before its consumer wakes.
        end_row(ending, self._book, kv_bytes_projected=self.scheduler.kv_bytes_projected,
                live_matchers=self.preparer.compiler.live_matchers)

    def fail_rows(self, error: BaseException, reason: FinishReason) -> None:
        """End every row the core holds with ``error`` (the engine is going away)."""
        self.scheduler.drain()
        for row in list(self.rows.values()):
            self.end(Ending(row, reason, error))


def end_row(ending: Ending, book: StatsBook, **gauges: int) -> None:
    """Publish a row's last event, counted first (also for a submit no core has seen)."""
    row = ending.row
    was = row.status
    event, completion = row.final(ending.reason, ending.error, ending.delta,
                                  ending.token_ids, ending.logprobs)
    book.ended(ending.reason,
               was_running=was in (RequestStatus.PREFILLING, RequestStatus.DECODING),
               was_pending=was is RequestStatus.WAITING and row.prepared is not None,
               **gauges)
    row.stream.publish(event, completion)


def _lane_row(row: Row) -> LaneRow:
    assert row.prepared is not None
    prepared = row.prepared
    return LaneRow(row.request_id, prepared.prompt_ids, prepared.params, prepared.head_len,
                   prepared.images)
