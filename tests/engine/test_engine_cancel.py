"""Cancellation at every stage evicts the row; siblings' greedy tokens are unchanged."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine import Engine, FinishReason, RequestTimeoutError
from tests.conftest import Turns, alone, greedy, prompts_of_lengths, request_for, wait_until


def test_cancelled_pending_request_is_never_prefilled(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=1)
    first, victim, last = prompts_of_lengths(eng, [10, 300, 20])
    tokens: list[int] = []
    h1 = eng.submit(request_for(first, greedy(30)), on_token=lambda t, _: tokens.append(t))
    wait_until(lambda: len(tokens) >= 1)
    h2 = eng.submit(request_for(victim, greedy(30)))
    h3 = eng.submit(request_for(last, greedy(5)))
    wait_until(lambda: eng.stats().pending == 2)
    before = eng.stats().prompt_tokens
    h2.cancel()
    result = h2.result(timeout=30)
    assert result.finish_reason is FinishReason.CANCELLED and result.token_ids == ()
    h1.result(), h3.result()
    assert eng.stats().prompt_tokens - before == len(last)  # the victim's 300 never prefilled
    assert eng.stats().cancelled == 1


def test_cancel_during_prefill_evicts_within_a_step(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=4, prefill_chunk=16)
    sibling, victim = prompts_of_lengths(eng, [12, 1500], seed=4)
    expected = alone(eng, [sibling], greedy(50))[0]
    sib_tokens: list[int] = []
    sib = eng.submit(request_for(sibling, greedy(50)), on_token=lambda t, _: sib_tokens.append(t))
    wait_until(lambda: len(sib_tokens) >= 2)
    victim_tokens: list[int] = []
    handle = eng.submit(request_for(victim, greedy(10)), on_token=lambda t,
                        _: victim_tokens.append(t))
    wait_until(lambda: eng.stats().running == 2)
    time.sleep(0.02)  # a few 16-token prefill chunks in; 1500 tokens need ~90 steps
    handle.cancel()
    assert handle.result(timeout=30).finish_reason is FinishReason.CANCELLED
    assert victim_tokens == []  # evicted while still prefilling
    wait_until(lambda: eng.stats().running <= 1)
    assert sib.result().token_ids == expected


def test_cancel_during_decode_leaves_siblings_unchanged(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [15, 40, 8, 90, 33], seed=8)
    params = greedy(48)
    reference = alone(tiny_engine, prompts, params)
    counts = [0] * len(prompts)

    def counter(i: int):  # type: ignore[no-untyped-def]
        def on_token(_t: int, _d: str) -> None:
            counts[i] += 1
        return on_token

    handles = [tiny_engine.submit(request_for(p, params), on_token=counter(i)) for i,
               p in enumerate(prompts)]
    wait_until(lambda: counts[2] >= 5)
    at_cancel = counts[2]
    handles[2].cancel()
    cancelled = handles[2].result()
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert counts[2] - at_cancel <= 1  # gone at the next step boundary
    assert cancelled.token_ids == reference[2][: len(cancelled.token_ids)]
    for i in (0, 1, 3, 4):
        assert handles[i].result().token_ids == reference[i]


def test_break_out_of_sync_stream_cancels(tiny_engine: Engine) -> None:
    handle = tiny_engine.submit(request_for(prompts_of_lengths(tiny_engine, [10])[0], greedy(200)))
    for n, _event in enumerate(handle):
        if n == 3:
            break
    wait_until(lambda: handle.done)
    assert handle.result().finish_reason is FinishReason.CANCELLED
    assert len(handle.result().token_ids) < 200
    wait_until(lambda: tiny_engine.stats().running == 0)


async def test_cancelling_an_async_task_evicts_the_row(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [10, 25], seed=9)
    expected = alone(tiny_engine, [prompts[1]], greedy(40))[0]
    victim = tiny_engine.submit(request_for(prompts[0], greedy(400)))
    sibling = tiny_engine.submit(request_for(prompts[1], greedy(40)))

    async def consume() -> int:
        n = 0
        async for _ in victim:
            n += 1
        return n

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    result = await victim.aresult()
    assert result.finish_reason is FinishReason.CANCELLED and len(result.token_ids) < 400
    assert (await sibling.aresult()).token_ids == expected


def test_timeout_cancels_and_raises(tiny_engine: Engine) -> None:
    prompt = prompts_of_lengths(tiny_engine, [10])[0]
    handle = tiny_engine.submit(request_for(prompt, greedy(1000)), timeout=0.05)
    with pytest.raises(RequestTimeoutError):
        handle.result(timeout=30)
    events = []
    with pytest.raises(TimeoutError):
        for event in tiny_engine.submit(request_for(prompt, greedy(1000)), timeout=0.05):
            events.append(event)
    assert events[-1].finish_reason is FinishReason.CANCELLED
    wait_until(lambda: tiny_engine.stats().running == 0)


def test_on_token_returning_false_stops_the_row(tiny_engine: Engine) -> None:
    seen: list[int] = []

    def stop_after_five(token: int, _delta: str) -> bool:
        seen.append(token)
        return len(seen) < 5

    result = tiny_engine.submit(request_for(prompts_of_lengths(tiny_engine, [9])[0], greedy(100)),
                                on_token=stop_after_five).result()
    assert result.finish_reason is FinishReason.STOP and len(result.token_ids) == 5


def test_cancellation_storm_leaves_no_rows(make_engine) -> None:  # type: ignore[no-untyped-def]
    turns = Turns()
    eng = make_engine(max_batch=6, prefill_chunk=32, probe=turns.probe)
    rng = random.Random(42)
    prompts = prompts_of_lengths(eng, [rng.randrange(4, 300) for _ in range(40)], seed=6)
    keep = list(range(0, 40, 5))
    params = greedy(30)
    reference = alone(eng, [prompts[i] for i in keep], params)
    handles = [eng.submit(request_for(p, params)) for p in prompts]
    for i, handle in enumerate(handles):
        if i not in keep:
            time.sleep(rng.random() * 0.01)
            handle.cancel()
    results = [h.result(timeout=60) for h in handles]
    assert [results[i].token_ids for i in keep] == reference
    settled = turns.settled()
    stats = eng.stats()
    assert stats.kv_bytes_projected == 0
    assert stats.cancelled == sum(r.finish_reason is FinishReason.CANCELLED for r in results)
    finished = sum(r.finish_reason is not FinishReason.CANCELLED for r in results)
    assert stats.completed == finished + len(keep)  # + the reference runs
    # No row is left in a lane, nor in mlx-lm's generator (its KV would still be held).
    assert settled.lane_rows == {"batch": 0, "serial": 0} and settled.batch_kv_bytes == 0


def test_a_leader_and_its_twin_cancelled_together_leave_nothing_in_the_batch(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    """Rows sharing a long head: the first prefills it, its twins wait. Cancelling the
    leader and a waiting twin in one turn used to start the twin (released by its leader)
    while it was being removed: it joined mlx-lm's generator and stayed there, decoding
    for no one, every step slower, until the engine stalled."""
    from engine import StepProbe
    from testkit.crossings import Admissions

    admissions = Admissions()
    reference = make_engine(prefix_cache_bytes=0)
    eng = make_engine(max_batch=8, prefill_chunk=16, probe=StepProbe(on_turn=admissions))
    for seed in range(3):  # a new head each time: none is stored yet, so twins wait for it
        head = prompts_of_lengths(eng, [240], seed=11 + seed)[0]
        prompts = [[*head, 40 + i, 50 + i, 60 + i] for i in range(3)]
        kept_alone = alone(reference, [prompts[2]], greedy(12))[0]
        handles = [eng.submit(request_for(p, greedy(12))) for p in prompts]
        for handle in handles[:2]:  # cancelled the turn they are admitted: in their prefill
            admissions.waiting[handle.request_id] = handle
        results = [h.result(timeout=60) for h in handles]
        assert [r.finish_reason for r in results[:2]] == [FinishReason.CANCELLED] * 2
        assert results[2].token_ids == kept_alone
        wait_until(lambda: eng.stats().running == 0 and eng.stats().kv_bytes_held == 0)
