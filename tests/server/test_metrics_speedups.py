"""``/metrics`` says, per model, which speed-ups are on for its caches, and why not."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]


def speedups(server: LiveServer) -> dict[str, tuple[float, dict[str, str]]]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {s.labels["speedup"]: (s.value, s.labels)
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "mlx_engine_speedup"}


def test_metrics_name_each_speed_up_its_state_and_the_cache_kinds(serve: Serve) -> None:
    server, eng = serve(speculation=0)
    found = speedups(server)
    assert set(found) == {"fast_forward", "speculation", "prefix_reuse", "prefix_disk"}
    assert found["fast_forward"][0] == 1.0 and found["prefix_reuse"][0] == 1.0
    value, labels = found["speculation"]
    assert value == 0.0 and labels["detail"] == "off: speculation=0"
    assert labels["model"] == "tiny" and labels["cache_kinds"] == "KVCache"
    assert {(s.name, s.on, s.detail) for s in eng.stats().speedups} == {
        (name, value == 1.0, labels["detail"]) for name, (value, labels) in found.items()}
