"""Scheduler: pure admission/queue/cancel logic, tested with hand-built inputs (no mlx)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.footprint import LayerFootprint, ModelFootprint
from engine.core.lane import LaneKind
from engine.core.scheduler import BatchMode, Scheduler, Ticket
from engine.errors import ContextLengthError, KVBudgetError

KV = ModelFootprint.of([LayerFootprint("KVCache", True, bytes_per_token=10)] * 2, 1000)


def ticket(rid: int, tokens: int = 10, lane: LaneKind = LaneKind.BATCH) -> Ticket:
    kv = KV.bytes_for(tokens)
    return Ticket(rid, tokens // 2, tokens - tokens // 2, kv, lane)


def test_admits_fifo_up_to_max_batch() -> None:
    s = Scheduler(KV, 2, None)
    for rid in range(1, 5):
        s.enqueue(ticket(rid))
    assert [t.request_id for t in s.plan().admit] == [1, 2]
    assert (s.running, s.pending) == (2, 2)
    assert s.plan().admit == []
    s.finish([1])
    assert [t.request_id for t in s.plan().admit] == [3]


def test_cancelled_pending_is_dropped_before_admission() -> None:
    s = Scheduler(KV, 1, None)
    for rid in (1, 2, 3):
        s.enqueue(ticket(rid))
    s.plan()
    s.cancel(2)
    plan = s.plan()
    assert plan.dropped == [2] and plan.evict == [] and plan.admit == []
    s.finish([1])
    assert [t.request_id for t in s.plan().admit] == [3]


def test_cancelled_running_is_evicted_and_frees_its_slot() -> None:
    s = Scheduler(KV, 1, None)
    s.enqueue(ticket(1))
    s.enqueue(ticket(2))
    s.plan()
    s.cancel(1)
    plan = s.plan()
    assert plan.evict == [1]
    assert [t.request_id for t in plan.admit] == [2]


def test_context_limit_rejects_with_both_numbers() -> None:
    s = Scheduler(KV, 4, None)
    with pytest.raises(ContextLengthError) as info:
        s.validate(900, 200)
    assert "900" in str(info.value) and "200" in str(info.value) and "1000" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_kv_budget_reject_alone_and_wait_beside_others() -> None:
    s = Scheduler(KV, 8, kv_budget_bytes=2000)  # 20 bytes/token -> 100 tokens
    with pytest.raises(KVBudgetError):
        s.validate(60, 60)
    big = Ticket(1, 50, 40, s.validate(50, 40), LaneKind.BATCH)  # 1800 bytes
    small = Ticket(2, 10, 10, s.validate(10, 10), LaneKind.BATCH)  # 400 bytes
    late = Ticket(3, 10, 10, s.validate(10, 10), LaneKind.BATCH)
    s.enqueue(small)
    s.plan()
    s.enqueue(big)
    s.enqueue(late)
    # big fits alone but not beside small: it waits, and FIFO keeps late behind it.
    assert s.plan().admit == []
    assert s.kv_bytes_projected == 400
    s.finish([2])
    assert [t.request_id for t in s.plan().admit] == [1]  # late does not fit beside big
    s.finish([1])
    assert [t.request_id for t in s.plan().admit] == [3]


def test_cache_grown_while_rows_run_is_shrunk_into_the_room_they_leave() -> None:
    cache = [0]
    reclaimed: list[int] = []

    def reclaim(limit: int) -> None:
        reclaimed.append(limit)
        cache[0] = min(cache[0], limit)

    s = Scheduler(KV, 8, kv_budget_bytes=2000, cache_bytes=lambda: cache[0], reclaim=reclaim)
    s.enqueue(Ticket(1, 50, 40, s.validate(50, 40), LaneKind.BATCH))  # 1800 bytes
    s.plan()
    cache[0] = 150  # a head stored while its row runs: within the 200 bytes left
    s.fit_cache()
    assert reclaimed == []
    cache[0] = 900  # more than the room beside the running row
    s.fit_cache()
    assert reclaimed == [200] and s.kv_bytes_projected + cache[0] <= 2000
    s.finish([1])
    s.fit_cache()  # the row ended: the whole budget is room again
    assert reclaimed == [200]
    Scheduler(KV, 8, None, cache_bytes=lambda: 10**9, reclaim=reclaim).fit_cache()  # no budget
    assert reclaimed == [200]


def test_sliding_window_caps_projected_bytes() -> None:
    fp = ModelFootprint.of(
        [LayerFootprint("RotatingKVCache", True, bytes_per_token=4, window=16),
         LayerFootprint("ArraysCache", True, fixed_bytes=100)], None)
    assert fp.bytes_for(8) == 32 + 100
    assert fp.bytes_for(1000) == 64 + 100
    assert fp.context_limit is None


def test_modes_and_serial_lane() -> None:
    assert Scheduler(KV, 1, None).mode is BatchMode.OFF
    assert Scheduler(KV, 4, None).mode is BatchMode.BATCH
    quant = ModelFootprint.of([LayerFootprint("QuantizedKVCache", False, bytes_per_token=5)], None)
    serial = Scheduler(quant, 4, None)
    assert serial.mode is BatchMode.SERIAL
    assert serial.lane_for(False) is LaneKind.SERIAL
    s = Scheduler(KV, 4, None)
    s.enqueue(ticket(1, lane=LaneKind.SERIAL))
    s.enqueue(ticket(2, lane=LaneKind.SERIAL))
    s.enqueue(ticket(3))
    plan = s.plan()
    assert plan.serial is not None and plan.serial.request_id == 1
    assert [t.request_id for t in plan.admit] == [3]
    assert s.plan().serial is None  # one serial row at a time
    s.cancel(1)
    plan = s.plan()
    assert plan.evict == [1] and plan.serial is not None and plan.serial.request_id == 2


def test_drain_forgets_everything() -> None:
    s = Scheduler(KV, 1, None)
    for rid in (1, 2):
        s.enqueue(ticket(rid))
    s.plan()
    assert sorted(s.drain()) == [1, 2]
    assert s.is_idle() and s.kv_bytes_projected == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "cancel", "finish", "plan"]),
                          st.integers(1, 40), st.integers(1, 60)), max_size=80),
       st.integers(1, 4), st.integers(600, 2000))
def test_invariants_under_random_operations(ops: list[tuple[str, int, int]], max_batch: int,
                                            budget: int) -> None:
    """Never over max_batch or the budget; FIFO; every request ends admitted or dropped."""
    s = Scheduler(KV, max_batch, budget)
    next_id, order, admitted, dropped = 1, [], [], []
    running: set[int] = set()
    for op, pick, size in ops:
        if op == "add":
            try:
                kv = s.validate(size, size)
            except KVBudgetError:
                continue
            s.enqueue(Ticket(next_id, size, size, kv))
            order.append(next_id)
            next_id += 1
        elif op == "cancel" and order:
            s.cancel(order[pick % len(order)])
        elif op == "finish" and running:
            done = sorted(running)[pick % len(running)]
            running.discard(done)
            s.finish([done])
        plan = s.plan()
        running -= set(plan.evict)
        dropped += plan.dropped
        running |= {t.request_id for t in plan.admit}
        admitted += [t.request_id for t in plan.admit]
        assert len(running) <= max_batch
        assert s.kv_bytes_projected <= budget
    assert admitted == sorted(admitted)  # FIFO admission order
    for rid in sorted(running):
        s.finish([rid])
    while s.pending:
        plan = s.plan()
        assert plan.admit, "a request that fits alone must be admitted once rows drain"
        for t in plan.admit:
            admitted.append(t.request_id)
            s.finish([t.request_id])
    assert set(admitted) | set(dropped) == set(order)
