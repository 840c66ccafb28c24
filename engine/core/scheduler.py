"""Admission, queueing and cancellation: pure bookkeeping, no mlx.

The engine thread calls ``plan()`` at every step boundary: cancellations are applied
first (pending requests are dropped before they are ever prefilled, running rows are
marked for eviction), then waiting requests are admitted FIFO while they fit under
``max_batch`` and the KV budget. Running rows are never evicted to admit others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from engine.core.footprint import ModelFootprint
from engine.core.lane import LaneKind
from engine.errors import ContextLengthError, KVBudgetError


class BatchMode(str, Enum):
    """What the engine can do with this model and config (reported by ``stats()``)."""

    OFF = "off"  # max_batch == 1
    SERIAL = "serial"  # the model's caches cannot merge rows
    BATCH = "batch"


@dataclass(frozen=True)
class Ticket:
    """The scheduler's view of one request."""

    request_id: int
    prompt_tokens: int
    max_tokens: int
    kv_bytes: int
    lane: LaneKind = LaneKind.BATCH


@dataclass
class StepPlan:
    """What the engine does at this step boundary, in this order."""

    dropped: list[int] = field(default_factory=list)  # pending, never prefilled
    evict: list[int] = field(default_factory=list)  # running rows to remove
    admit: list[Ticket] = field(default_factory=list)  # rows to insert into the batch
    serial: Ticket | None = None  # request to start on the serial lane

    def __bool__(self) -> bool:
        return bool(self.dropped or self.evict or self.admit or self.serial)

    def admitted(self, lane: LaneKind) -> list[Ticket]:
        """The tickets this plan starts on ``lane``."""
        if lane is LaneKind.BATCH:
            return list(self.admit)
        return [self.serial] if self.serial is not None else []


class Scheduler:
    """FIFO admission by row count and projected KV bytes; cancellation bookkeeping."""

    def __init__(
        self,
        footprint: ModelFootprint,
        max_batch: int,
        kv_budget_bytes: int | None,
        *,
        cache_bytes: Callable[[], int] = lambda: 0,
        reclaim: Callable[[int], object] = lambda limit: None,
    ) -> None:
        """``cache_bytes`` reports the prefix cache's size; ``reclaim(limit)`` shrinks it
        to at most ``limit`` bytes, which admission does before making anyone wait."""
        self.footprint = footprint
        self.max_batch = max_batch
        self.kv_budget_bytes = kv_budget_bytes
        self._cache_bytes = cache_bytes
        self._reclaim = reclaim
        self._pending: dict[LaneKind, deque[Ticket]] = {lane: deque() for lane in LaneKind}
        self._running: dict[int, Ticket] = {}
        self._serial: Ticket | None = None
        self._cancelled: set[int] = set()

    @property
    def mode(self) -> BatchMode:
        if not self.footprint.batchable:
            return BatchMode.SERIAL
        return BatchMode.OFF if self.max_batch == 1 else BatchMode.BATCH

    def lane_for(self, wants_serial: bool) -> LaneKind:
        return LaneKind.SERIAL if wants_serial or self.mode is BatchMode.SERIAL else LaneKind.BATCH

    def validate(self, prompt_tokens: int, max_tokens: int) -> int:
        """Reject what can never run; return the request's worst-case KV bytes."""
        limit = self.footprint.context_limit
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise ContextLengthError(prompt_tokens, max_tokens, limit)
        kv_bytes = self.footprint.bytes_for(prompt_tokens + max_tokens)
        if self.kv_budget_bytes is not None and kv_bytes > self.kv_budget_bytes:
            raise KVBudgetError(kv_bytes, self.kv_budget_bytes)
        return kv_bytes

    def enqueue(self, ticket: Ticket) -> None:
        self._pending[ticket.lane].append(ticket)

    def cancel(self, request_id: int) -> None:
        """Mark for removal at the next ``plan()``; unknown ids are ignored there."""
        self._cancelled.add(request_id)

    def finish(self, request_ids: Iterable[int]) -> None:
        """Running rows ended on their own (stop, length, error): their room is free."""
        for request_id in request_ids:
            self._running.pop(request_id, None)
            if self._serial is not None and self._serial.request_id == request_id:
                self._serial = None
            self._cancelled.discard(request_id)

    def plan(self) -> StepPlan:
        plan = StepPlan()
        if self._cancelled:
            self._apply_cancellations(plan)
        self._admit(plan)
        return plan

    def _apply_cancellations(self, plan: StepPlan) -> None:
        for lane, queue in self._pending.items():
            kept = deque(t for t in queue if t.request_id not in self._cancelled)
            plan.dropped.extend(t.request_id for t in queue if t.request_id in self._cancelled)
            self._pending[lane] = kept
        for request_id in sorted(self._cancelled & self._running.keys()):
            plan.evict.append(request_id)
            del self._running[request_id]
        if self._serial is not None and self._serial.request_id in self._cancelled:
            plan.evict.append(self._serial.request_id)
            self._serial = None
        self._cancelled.clear()

    def _fits(self, ticket: Ticket) -> bool:
        if self.kv_budget_bytes is None:
            return True
        needed = self.kv_bytes_projected + ticket.kv_bytes
        if needed > self.kv_budget_bytes:
            return False
        if needed + self._cache_bytes() > self.kv_budget_bytes:
            self._reclaim(self.kv_budget_bytes - needed)
        return needed + self._cache_bytes() <= self.kv_budget_bytes

    def fit_cache(self) -> None:
        """Shrink the prefix cache into the budget's room beside the running rows.

        Admission makes room before a row is admitted, but the cache also grows while rows
        run: a chat head is stored while its leader still prefills, and an evicted row's KV
        is stored after the plan that admitted others. The engine calls this after applying
        each plan and after each step, so running rows plus cache never exceed the budget
        at a step boundary.
        """
        if self.kv_budget_bytes is None:
            return
        room = max(0, self.kv_budget_bytes - self.kv_bytes_projected)
        if self._cache_bytes() > room:
            self._reclaim(room)

    def _admit(self, plan: StepPlan) -> None:
        # Strict FIFO per lane: a head that does not fit yet blocks those behind it,
        # so a large request cannot starve; it fits alone, so it runs once rows drain.
        batch_queue = self._pending[LaneKind.BATCH]
        while batch_queue and len(self._running) < self.max_batch and self._fits(batch_queue[0]):
            ticket = batch_queue.popleft()
            self._running[ticket.request_id] = ticket
            plan.admit.append(ticket)
        serial_queue = self._pending[LaneKind.SERIAL]
        if self._serial is None and serial_queue and self._fits(serial_queue[0]):
            self._serial = serial_queue.popleft()
            plan.serial = self._serial

    @property
    def running(self) -> int:
        return len(self._running) + (self._serial is not None)

    @property
    def pending(self) -> int:
        return sum(len(queue) for queue in self._pending.values())

    @property
    def kv_bytes_projected(self) -> int:
        serial = self._serial.kv_bytes if self._serial is not None else 0
        return sum(t.kv_bytes for t in self._running.values()) + serial

    def is_idle(self) -> bool:
        return not self._running and self._serial is None and self.pending == 0

    def drain(self) -> list[int]:
        """Forget every request (shutdown, model failure); returns their ids."""
        ids = [t.request_id for queue in self._pending.values() for t in queue]
        ids.extend(self._running)
        if self._serial is not None:
            ids.append(self._serial.request_id)
        for queue in self._pending.values():
            queue.clear()
        self._running.clear()
        self._serial = None
        self._cancelled.clear()
        return ids
