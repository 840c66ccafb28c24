"""A churned HTTP load (streams read to the end or dropped, client timeouts, bad requests)
from concurrent clients on a real loopback server: no 5xx, every row drains, and memory
stays inside what the settings allow, reported the same by ``stats()`` and ``/metrics``.

A bounded version of ``bench/memory_soak.py --server`` (docs/memory.md).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineStats
from tests.conftest import wait_until
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]
MiB = 1 << 20
CLIENTS = 16
ROUNDS = 3
PER_ROUND = 48
KINDS = ("stream_full", "stream_dropped", "full", "client_timeout", "bad_request")
BAD_BODIES: tuple[object, ...] = (
    {"model": "tiny", "messages": []},
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "tiny", "messages": "not a list"},
    "not json at all",
)


def _one(client: httpx.Client, url: str, kind: str, rng: random.Random) -> int | str:
    """One request of a kind; its status code, or what the client saw instead."""
    body = {"model": "tiny", "max_tokens": rng.choice((8, 32, 96)), "messages": [
        {"role": "user", "content": f"Tell me about request {rng.randrange(1000)} at length."}]}
    if kind == "bad_request":
        bad = rng.choice(BAD_BODIES)
        content = bad if isinstance(bad, str) else None
        response = client.post(url, content=content, json=None if content else bad,
                               headers={"content-type": "application/json"})
        return response.status_code
    if kind == "client_timeout":
        try:
            return client.post(url, json={**body, "max_tokens": 400}, timeout=0.05).status_code
        except httpx.TimeoutException:
            return "timeout"  # the server sees the disconnect and cancels the row
    if kind == "full":
        return client.post(url, json=body).status_code
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        keep = None if kind == "stream_full" else rng.choice((1, 3, 6))
        for read, _ in enumerate(lines, 1):
            if keep is not None and read >= keep:
                break  # leaving the block closes the connection mid-stream
        return response.status_code


def _round(server: LiveServer, seed: int, outcomes: Counter[int | str]) -> None:
    url = server.url + "/v1/chat/completions"
    lock = threading.Lock()
    jobs = list(range(PER_ROUND))

    def client_loop(worker: int) -> None:
        rng = random.Random(seed * 100 + worker)
        with httpx.Client(timeout=60) as client:
            while True:
                with lock:
                    if not jobs:
                        return
                    jobs.pop()
                outcome = _one(client, url, rng.choice(KINDS), rng)
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a client hung"


def _idle(eng: Engine) -> EngineStats:
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=30)
    # Once idle the engine collects cycles, drops MLX's cached buffers and trims the heap.
    wait_until(lambda: eng.stats().mlx_cache_bytes == 0, timeout=10)
    return eng.stats()


def _gauges(server: LiveServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("model") == "tiny"}


def test_a_churned_http_load_stays_inside_the_memory_its_settings_allow(serve: Serve) -> None:
    server, eng = serve(max_batch=16, kv_budget_bytes=8 * MiB, prefix_cache_bytes=2 * MiB,
                        buffer_cache_bytes=16 * MiB)
    httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    # MLX's active bytes are the process's: other engines alive in this test session (an
    # embedding model another test loaded) count too, so "at rest" is measured, not assumed.
    warm = _idle(eng)
    at_rest = warm.mlx_active_bytes - warm.prefix_bytes
    assert at_rest >= warm.weights_bytes
    outcomes: Counter[int | str] = Counter()
    rounds = []
    for seed in range(ROUNDS):
        _round(server, seed, outcomes)
        rounds.append(_idle(eng))
    assert sum(outcomes.values()) == ROUNDS * PER_ROUND
    assert not [code for code in outcomes if isinstance(code, int) and code >= 500], outcomes
    assert outcomes[200] and any(isinstance(c, int) and 400 <= c < 500 for c in outcomes)
    stats = rounds[-1]
    assert stats.cancelled > 0 and stats.completed > 0 and stats.failed == 0
    assert stats.kv_bytes_projected == 0 and stats.live_matchers == 0
    # The settings, as the engine resolved them.
    assert (stats.kv_budget_bytes, stats.prefix_cache_limit_bytes,
            stats.buffer_cache_limit_bytes) == (8 * MiB, 2 * MiB, 16 * MiB)
    assert 0 < stats.prefix_bytes <= stats.prefix_cache_limit_bytes
    # Idle, MLX holds what it held at rest and the prefix store (exact-size copies; the allocator's
    # rounding on the tiny model's small arrays measured under 25%) and nothing cached.
    assert stats.mlx_active_bytes <= at_rest + 1.25 * stats.prefix_bytes + MiB
    assert stats.mlx_cache_bytes == 0
    # The formula: weights + KV budget + buffer cache + runtime (resident at load less the
    # weights, plus a step allowance) bounds the whole process, round after round.
    assert all(0 < r.resident_bytes <= r.resident_bound_bytes for r in rounds)
    gauges = _gauges(server)
    assert gauges["mlx_engine_resident_bound_bytes"] == stats.resident_bound_bytes
    assert gauges["mlx_engine_kv_budget_bytes"] == 8 * MiB
    assert gauges["mlx_engine_prefix_cache_limit_bytes"] == 2 * MiB
    assert gauges["mlx_engine_mlx_cache_limit_bytes"] == 16 * MiB
    assert gauges["mlx_engine_weights_bytes"] == stats.weights_bytes > 0
    assert gauges["mlx_engine_process_resident_bytes"] > 0
    assert gauges["mlx_engine_mlx_active_bytes"] >= stats.weights_bytes
    assert "mlx_engine_mlx_cache_bytes" in gauges
