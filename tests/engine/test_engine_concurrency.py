"""Many callers at once: threads, asyncio tasks, and trio through anyio, on one engine."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from engine import Engine
from tests.conftest import alone, greedy, prompts_of_lengths, request_for


def test_sixteen_threads_submit_at_once(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [5 + 7 * i for i in range(16)], seed=21)
    params = greedy(32)
    reference = alone(tiny_engine, prompts, params)
    results: dict[int, tuple[int, ...]] = {}
    barrier = threading.Barrier(16)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = tiny_engine.submit(request_for(prompts[i],
                                                    params)).result(timeout=60).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(16)] == reference
    assert tiny_engine.stats().peak_running >= 8


async def test_sixteen_asyncio_tasks_stream_at_once(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [3 + 5 * i for i in range(16)], seed=22)
    params = greedy(32)
    reference = alone(tiny_engine, prompts, params)

    async def stream(p: list[int]) -> tuple[int, ...]:
        ids: list[int] = []
        async for event in tiny_engine.submit(request_for(p, params)):
            ids.extend(event.token_ids)
        return tuple(ids)

    assert await asyncio.gather(*(stream(p) for p in prompts)) == reference
    assert tiny_engine.stats().peak_running >= 8


def test_trio_tasks_through_anyio(tiny_engine: Engine) -> None:
    pytest.importorskip("trio", reason="trio is not installed")
    prompts = prompts_of_lengths(tiny_engine, [4, 9, 30, 12], seed=23)
    params = greedy(20)
    reference = alone(tiny_engine, prompts, params)
    results: dict[int, tuple[int, ...]] = {}

    async def one(i: int) -> None:
        ids: list[int] = []
        async for event in tiny_engine.submit(request_for(prompts[i], params)):
            ids.extend(event.token_ids)
        results[i] = tuple(ids)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)

    anyio.run(main, backend="trio")
    assert [results[i] for i in range(len(prompts))] == reference


def test_two_event_loops_in_two_threads(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [6, 16], seed=24)
    params = greedy(16)
    reference = alone(tiny_engine, prompts, params)
    out: dict[int, tuple[int, ...]] = {}

    def run_loop(i: int) -> None:
        out[i] = asyncio.run(tiny_engine.submit(request_for(prompts[i],
                                                            params)).aresult()).token_ids

    threads = [threading.Thread(target=run_loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[0], out[1]] == reference
