"""A churn workload through the engine's public API, shared by the CI soak test and
``bench/soak.py``.

Requests of every kind (plain, sampled, seeded serial-lane, regex, schema, forced tool
call, a raising callback, a raising logits processor) arrive from threads, asyncio tasks
and trio tasks and end at a random stage: not at all, before admission, after k tokens, a
``break`` out of a sync stream, ``aclose`` of an async stream, a cancelled task, a
``timeout=``, trio's ``move_on_after``. Greedy "needle" rows that nobody cancels must
produce exactly their tokens alone. Everything is counted so the totals can be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine import (
    ChatRequest,
    Engine,
    FinishReason,
    JsonSchema,
    Regex,
    Request,
    RequestTimeoutError,
    SamplingParams,
    TextRequest,
)

KINDS = ("plain", "sampled", "seeded", "regex", "schema", "tool", "bad_callback",
         "bad_processor")
SYNC_STAGES = ("none", "before_admission", "after_tokens", "break", "timeout")
ASYNC_STAGES = ("none", "before_admission", "after_tokens", "aclose", "task_cancel")
TRIO_STAGES = ("none", "before_admission", "aclose", "move_on_after")
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}
SCHEMA = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]})
NEEDLES = ("The needle row number one", "A second needle, somewhat longer than the first")
NEEDLE_PARAMS = SamplingParams(max_tokens=24, temperature=0.0)


class _CallbackBug(RuntimeError):
    pass


def rss_bytes() -> int:
    """Resident set size now (Linux), else the peak (macOS reports it in bytes)."""
    with contextlib.suppress(OSError), open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@dataclass
class ChurnReport:
    """What a churn run did; ``submitted`` counts every request the engine accepted."""

    submitted: int = 0
    by_stage: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # finish reason or error type
    needle_mismatches: int = 0
    needles: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, stage: str, kind: str, outcome: str) -> None:
        with self.lock:
            self.submitted += 1
            self.by_stage[stage] += 1
            self.by_kind[kind] += 1
            self.outcomes[outcome] += 1


class Churn:
    """Drives the workload on one engine; ``reference`` is the needles' tokens alone."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.rng_lock = threading.Lock()
        self.report = ChurnReport()
        self.reference = [engine.submit(TextRequest(n, NEEDLE_PARAMS)).result(timeout=120)
                          .token_ids for n in NEEDLES]

    def _pick(self, choices: tuple[str, ...]) -> str:
        with self.rng_lock:
            return self.rng.choice(choices)

    def _int(self, low: int, high: int) -> int:
        with self.rng_lock:
            return self.rng.randint(low, high)

    def _request(self, kind: str, i: int) -> tuple[Request, dict[str, Any]]:
        """A request of ``kind`` and the submit options it goes with (``on_token``)."""
        prompt = f"request {i}: say something about {kind} " * self._int(1, 4)
        tokens = self._int(4, 24)
        options: dict[str, Any] = {}
        if kind == "tool":
            return ChatRequest.from_openai([{"role": "user", "content": prompt}],
                                           SamplingParams(max_tokens=48), tools=[TOOL],
                                           tool_choice="required"), options
        if kind == "sampled":
            params = SamplingParams(max_tokens=tokens, temperature=0.8)
        elif kind == "seeded":
            params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=i)
        elif kind == "regex":
            params = SamplingParams(max_tokens=tokens, constraint=Regex("[a-z]{1,12}"))
        elif kind == "schema":
            params = SamplingParams(max_tokens=tokens, constraint=SCHEMA)
        elif kind == "bad_processor":
            calls = [0]

            def processor(history: Any, logits: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3:
                    raise ValueError("processor bug")
                return logits

            params = SamplingParams(max_tokens=tokens, logits_processors=(processor,))
        else:
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
        if kind == "bad_callback":
            def explode(_token: int, _text: str) -> None:
                raise _CallbackBug("callback bug")
            options["on_token"] = explode
        return TextRequest(prompt, params), options

    @staticmethod
    def _outcome(run: Callable[[], Any]) -> str:
        try:
            result = run()
        except (RequestTimeoutError, _CallbackBug, ValueError) as exc:
            return type(exc).__name__
        if result is None:
            return "cancelled_by_caller"
        return FinishReason(result.finish_reason).value

    # ----- one request per driver --------------------------------------------------------

    def sync_one(self, i: int) -> None:
        if i % 25 == 0:
            self._needle(i)
            return
        kind, stage = self._pick(KINDS), self._pick(SYNC_STAGES)
        request, options = self._request(kind, i)
        if stage == "timeout":
            options["timeout"] = 0.001 * self._int(1, 20)
        handle = self.engine.submit(request, **options)

        def run() -> Any:
            if stage == "before_admission":
                handle.cancel()
            elif stage == "after_tokens":
                wanted, seen = self._int(1, 6), 0
                for event in handle:
                    seen += len(event.token_ids)
                    if seen >= wanted:
                        handle.cancel()
                        break
            elif stage == "break":
                for _event in handle:
                    break
                return None
            return handle.result(timeout=120)

        self.report.count(stage, kind, self._outcome(run))

    def _needle(self, i: int) -> None:
        which = i % len(NEEDLES)
        needle = TextRequest(NEEDLES[which], NEEDLE_PARAMS)
        tokens = self.engine.submit(needle).result(timeout=120).token_ids
        with self.report.lock:
            self.report.needles += 1
            self.report.needle_mismatches += tokens != self.reference[which]
        self.report.count("none", "needle", "stop_or_length")

    async def async_one(self, i: int) -> None:
        kind, stage = self._pick(KINDS), self._pick(ASYNC_STAGES)
        request, options = self._request(kind, i)
        handle = self.engine.submit(request, **options)
        outcome = "cancelled_by_caller"
        try:
            if stage == "before_admission":
                handle.cancel()
            elif stage in ("after_tokens", "aclose"):
                events = handle.__aiter__()
                async for event in events:
                    if stage == "aclose" or len(event.token_ids) >= 1:
                        await events.aclose()  # type: ignore[attr-defined]
                        break
            elif stage == "task_cancel":
                task = asyncio.ensure_future(handle.aresult())
                await asyncio.sleep(0.001 * self._int(0, 20))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if stage in ("none", "before_admission", "after_tokens"):
                outcome = FinishReason((await handle.aresult()).finish_reason).value
            else:
                # The caller walked away: the engine must still end the row, evicted.
                await asyncio.wait_for(handle.aresult(), 120)
        except (RequestTimeoutError, _CallbackBug, ValueError) as exc:
            outcome = type(exc).__name__
        self.report.count(stage, kind, outcome)

    async def trio_one(self, i: int) -> None:
        kind, stage = self._pick(KINDS), self._pick(TRIO_STAGES)
        request, options = self._request(kind, i)
        handle = self.engine.submit(request, **options)
        outcome = "cancelled_by_caller"
        try:
            if stage == "before_admission":
                handle.cancel()
                outcome = FinishReason((await handle.aresult()).finish_reason).value
            elif stage == "aclose":
                events = handle.__aiter__()
                async for _event in events:
                    await events.aclose()  # type: ignore[attr-defined]
                    break
            elif stage == "move_on_after":
                with anyio.move_on_after(0.001 * self._int(0, 20)):
                    await handle.aresult()
            else:
                outcome = FinishReason((await handle.aresult()).finish_reason).value
        except (RequestTimeoutError, _CallbackBug, ValueError) as exc:
            outcome = type(exc).__name__
        self.report.count(stage, kind, outcome)

    # ----- a round: the three drivers at once ----------------------------------------------

    def run_round(self, requests: int, start: int = 0) -> None:
        """About ``requests`` requests: half from 4 threads, a quarter each asyncio and trio."""
        threads, tasks = requests // 2, requests // 4
        ids = iter(range(start, start + requests))
        sync_ids = [next(ids) for _ in range(threads)]
        async_ids = [next(ids) for _ in range(tasks)]
        trio_ids = list(ids)

        async def asyncio_side() -> None:
            await asyncio.gather(*(self.async_one(i) for i in async_ids))

        async def trio_side() -> None:
            async with anyio.create_task_group() as group:
                for i in trio_ids:
                    group.start_soon(self.trio_one, i)

        with ThreadPoolExecutor(6) as pool:  # the two event loops first: 4 threads are left
            futures = [pool.submit(asyncio.run, asyncio_side()),
                       pool.submit(anyio.run, trio_side, backend="trio")]
            futures += [pool.submit(self.sync_one, i) for i in sync_ids]
            for future in futures:
                future.result(timeout=600)
