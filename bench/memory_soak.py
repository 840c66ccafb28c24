"""Memory soak: waves of concurrent streams on the default model and settings, memory per wave.

Each wave opens ``--streams`` streams at once; a quarter are read to the end, the rest are
dropped after 3, 10 or 40 chunks. ``--mode inprocess`` streams through ``ChatMLXBatch``;
``--mode server`` starts ``python -m mlx_providers.server`` and sends the same streams over
HTTP, plus client timeouts and bad requests, reading the server's memory from /metrics.
After each wave (once the engine is idle) it prints the process's resident bytes, MLX's
active and cached bytes, the prefix store, and the bound the settings give
(weights + KV budget + buffer cache limit + runtime, docs/memory.md). It stops once the
resident bytes moved less than ``--flat-mb`` over the last two waves.

    python bench/memory_soak.py --mode inprocess [--waves 8] [--streams 32] [--max-tokens 400]
    python bench/memory_soak.py --mode server [--model DIR] [--port 8765]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineStats, TextRequest
from engine.core.memory import resident_bytes

MB = 1 << 20
DROP_AFTER = (3, 10, 40)  # chunks a dropped stream reads first


@dataclass
class Memory:
    """One wave's figures, from stats() in process or /metrics from the server."""

    resident: float
    active: float
    cached: float
    prefix: float
    entries: float
    bound: float
    kv_budget: float
    prefix_limit: float
    weights: float


def _memory_of_stats(stats: EngineStats) -> Memory:
    return Memory(stats.resident_bytes, stats.mlx_active_bytes, stats.mlx_cache_bytes,
                  stats.prefix_bytes, stats.prefix_entries, stats.resident_bound_bytes,
                  stats.kv_budget_bytes, stats.prefix_cache_limit_bytes, stats.weights_bytes)


class PeakSampler:
    """The highest resident bytes seen while a wave runs (sampled on a thread)."""

    def __init__(self, read: Callable[[], float], every: float) -> None:
        self.peak = 0.0
        self._read, self._every = read, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.peak = max(self.peak, self._read())
            except httpx.HTTPError:
                pass

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _header() -> None:
    print(f"{'wave':>4} {'peak RSS':>8} {'RSS MB':>7} {'active':>7} {'cache':>6} {'prefix':>7} "
          f"{'entries':>7} {'RSS-active':>10} {'bound MB':>8} {'outcomes':>10} {'s':>5}",
          flush=True)


def _row(wave: int, memory: Memory, outcomes: str, seconds: float, peak: float = 0) -> None:
    print(f"{wave:>4} {peak / MB:>8.0f} {memory.resident / MB:>7.0f} {memory.active / MB:>7.0f} "
          f"{memory.cached / MB:>6.0f} {memory.prefix / MB:>7.0f} {memory.entries:>7.0f} "
          f"{(memory.resident - memory.active) / MB:>10.0f} {memory.bound / MB:>8.0f} "
          f"{outcomes:>10} {seconds:>5.0f}", flush=True)


def _flat(history: list[float], flat_mb: float) -> bool:
    return len(history) >= 3 and max(history[-3:]) - min(history[-3:]) < flat_mb * MB


# ----- in process: ChatMLXBatch streams ------------------------------------------------------

async def _inprocess_wave(chat: object, streams: int, wave: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    async def one(i: int) -> None:
        keep = None if i % 4 == 0 else DROP_AFTER[i % 3]
        prompt = f"Write a long story about a lighthouse keeper, number {wave * 1000 + i}."
        chunks = 0
        async for _ in chat.astream(prompt):  # type: ignore[attr-defined]
            chunks += 1
            if keep is not None and chunks >= keep:
                break  # the generator closes: the row is cancelled at the next step
        outcomes["full" if keep is None else "dropped"] += 1

    await asyncio.gather(*(one(i) for i in range(streams)))
    return outcomes


def _idle_stats(eng: Engine) -> EngineStats:
    while (stats := eng.stats()).running or stats.pending:
        time.sleep(0.1)
    time.sleep(1.0)  # the engine collects, clears MLX's cache and trims the heap when idle
    return eng.stats()


def run_inprocess(args: argparse.Namespace) -> None:
    from mlx_providers import ChatMLXBatch

    chat = ChatMLXBatch(model=args.model, max_tokens=args.max_tokens)
    eng = chat.engine  # type: ignore[attr-defined]
    eng.submit(TextRequest("warm up")).result(timeout=300)
    stats = _idle_stats(eng)
    print(f"in process: KV budget {stats.kv_budget_bytes / MB:.0f} MB, prefix cap "
          f"{stats.prefix_cache_limit_bytes / MB:.0f} MB, buffer cache cap "
          f"{stats.buffer_cache_limit_bytes / MB:.0f} MB, weights "
          f"{stats.weights_bytes / MB:.0f} MB", flush=True)
    _header()
    _row(0, _memory_of_stats(stats), "-", 0)
    history = [float(stats.resident_bytes)]
    for wave in range(1, args.waves + 1):
        started = time.perf_counter()
        with PeakSampler(lambda: float(resident_bytes()), 0.1) as sampler:
            outcomes = asyncio.run(_inprocess_wave(chat, args.streams, wave))
        memory = _memory_of_stats(_idle_stats(eng))
        history.append(memory.resident)
        _row(wave, memory, f"{outcomes['full']}f/{outcomes['dropped']}d",
             time.perf_counter() - started, sampler.peak)
        if _flat(history, args.flat_mb):
            break


# ----- through the server: HTTP streams, timeouts, bad requests -------------------------------

def _http_one(client: httpx.Client, url: str, i: int, wave: int, max_tokens: int) -> str:
    rng = random.Random(wave * 1000 + i)
    body = {"model": "default", "max_tokens": max_tokens, "stream": True, "messages": [
        {"role": "user", "content": f"Write a long story about a lighthouse, number "
                                    f"{wave * 1000 + i}."}]}
    kind = i % 8
    if kind == 7:  # a bad request
        bad = rng.choice(({**body, "messages": []}, {**body, "max_tokens": -1}, "{not json"))
        response = client.post(url, content=bad if isinstance(bad, str) else None,
                               json=None if isinstance(bad, str) else bad)
        return str(response.status_code)
    if kind == 6:  # a client that gives up before the answer
        try:
            return str(client.post(url, json={**body, "stream": False}, timeout=0.5)
                       .status_code)
        except httpx.TimeoutException:
            return "timeout"
    keep = None if kind % 4 == 0 else DROP_AFTER[kind % 3]
    with client.stream("POST", url, json=body) as response:
        for read, _ in enumerate(response.iter_lines(), 1):
            if keep is not None and read >= keep:
                break
        return str(response.status_code)


def _http_wave(url: str, streams: int, wave: int, max_tokens: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            outcome = _http_one(http, url, i, wave, max_tokens)
        with lock:
            outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def _scrape(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("mlx_engine_") and "{" in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


def _server_memory(base: str) -> Memory:
    """The server's memory once idle (running and pending rows at zero)."""
    while True:
        m = _scrape(base)
        if not m.get("mlx_engine_running_rows") and not m.get("mlx_engine_pending_rows"):
            break
        time.sleep(0.2)
    time.sleep(1.0)
    m = _scrape(base)
    return Memory(m["mlx_engine_process_resident_bytes"], m["mlx_engine_mlx_active_bytes"],
                  m["mlx_engine_mlx_cache_bytes"], m["mlx_engine_prefix_cache_bytes"],
                  float("nan"), m["mlx_engine_resident_bound_bytes"],
                  m["mlx_engine_kv_budget_bytes"], m["mlx_engine_prefix_cache_limit_bytes"],
                  m["mlx_engine_weights_bytes"])


def run_server(args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "mlx_providers.server", "--port", str(args.port),
               "--served-model-name", "default", "--embedding-model", "none",
               "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, env={**os.environ})
    base = f"http://127.0.0.1:{args.port}"
    try:
        _wait_for(lambda: httpx.get(base + "/health", timeout=2).status_code == 200, 300)
        httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        memory = _server_memory(base)
        print(f"server: KV budget {memory.kv_budget / MB:.0f} MB, prefix cap "
              f"{memory.prefix_limit / MB:.0f} MB, weights {memory.weights / MB:.0f} MB",
              flush=True)
        _header()
        _row(0, memory, "-", 0)
        history = [memory.resident]
        for wave in range(1, args.waves + 1):
            started = time.perf_counter()
            with PeakSampler(lambda: _scrape(base)["mlx_engine_process_resident_bytes"],
                             0.5) as sampler:
                outcomes = _http_wave(base + "/v1/chat/completions", args.streams, wave,
                                      args.max_tokens)
            memory = _server_memory(base)
            history.append(memory.resident)
            codes = ",".join(f"{k}:{v}" for k, v in sorted(outcomes.items()))
            _row(wave, memory, codes, time.perf_counter() - started, sampler.peak)
            if any(code.startswith("5") for code in outcomes):
                print("5xx answers:", outcomes, flush=True)
            if _flat(history, args.flat_mb):
                break
    finally:
        server.terminate()
        print("server exit status:", server.wait(60), flush=True)


def _wait_for(ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("inprocess", "server"), default="inprocess")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M")
    parser.add_argument("--waves", type=int, default=8)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--flat-mb", type=float, default=16.0,
                        help="stop once RSS moved less than this over the last two waves")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    (run_inprocess if args.mode == "inprocess" else run_server)(args)


if __name__ == "__main__":
    main()
