"""After a storm the device holds what the engine reports: the warm-up level plus the
prefix store, not batch buffers pinned by reference cycles until Python's GC runs. The idle
collection that frees them waits for quiet, and freezes what it leaves only until the next."""

from __future__ import annotations

import base64
import gc
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, SamplingParams, TextRequest
from engine.runtime.turns import IDLE_COLLECT_SECONDS
from testkit.churn import Churn
from tests.conftest import wait_until


def _idle_stats(eng: Engine) -> tuple[int, int]:
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=60)
    stats = eng.stats()
    return stats.mlx_active_bytes, stats.prefix_bytes


def test_memory_returns_to_the_warm_level_after_a_storm(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng: Engine = make_engine(max_batch=16, prefix_cache_bytes=0)
    eng.submit(TextRequest("warm up", SamplingParams(max_tokens=4))).result(timeout=60)
    warm, _ = _idle_stats(eng)
    Churn(eng, seed=11).run_round(600)
    _idle_stats(eng)
    # Other tests' idle engines share the allocator, so a bound, not equality; the slack is
    # for small per-engine caches (samplers' scalars, ~300 B measured). Before the engine
    # collected cycles when idle, 6-16 MB of finished batches stayed pinned here.
    wait_until(lambda: eng.stats().mlx_active_bytes <= warm + (64 << 10), timeout=30)


def test_the_prefix_store_reports_what_it_keeps_alive(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng: Engine = make_engine(max_batch=16, prefix_cache_bytes=4 << 20)
    eng.submit(TextRequest("warm up", SamplingParams(max_tokens=4))).result(timeout=60)
    warm, before = _idle_stats(eng)
    churn = Churn(eng, seed=12)
    churn.run_round(600)
    _, stored = _idle_stats(eng)
    assert stored > before and eng.stats().prefix_entries > 10
    # Entries are exact-size copies; what is left over is the allocator's own rounding
    # (measured 8-13% of the stored bytes on the tiny model's small entries).
    wait_until(lambda: eng.stats().mlx_active_bytes <= warm + 1.25 * eng.stats().prefix_bytes,
               timeout=30)



def test_back_to_back_one_turn_requests_are_not_collected_until_quiet(
        make_engine: Callable[..., Engine], tiny_vlm_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle collection waits for IDLE_COLLECT_SECONDS with nothing to run: requests
    that each start and end within one turn (a turn over an image whose prefix is cached)
    are not quiet, however long they go on. Before, its clock ran from the first one's end
    and a full collection stalled the engine every IDLE_COLLECT_SECONDS."""
    from testkit.vision_model import solid_image  # the vision extra: only where it runs

    eng: Engine = make_engine(tiny_vlm_dir, max_batch=4)
    image = base64.b64encode(solid_image((200, 40, 40), 40, noise=20)).decode()
    request = ChatRequest.from_openai(
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "Describe it."}]}], SamplingParams(max_tokens=1))
    eng.submit(request).result(timeout=60)
    collections: list[float] = []
    collect = gc.collect

    def counted(*args: Any) -> int:
        if threading.current_thread().name.startswith("mlx-engine"):
            collections.append(time.monotonic())
        return collect(*args)

    monkeypatch.setattr(gc, "collect", counted)
    time.sleep(2 * IDLE_COLLECT_SECONDS)  # the first request's collection
    collections.clear()
    busy_until = time.monotonic() + 4 * IDLE_COLLECT_SECONDS
    while time.monotonic() < busy_until:
        eng.submit(request).result(timeout=60)
    assert collections == []
    wait_until(lambda: bool(collections), timeout=10)  # and once quiet, it collects


class _Node:
    """A reference cycle (``self.loop``), found only by the cyclic GC."""

    def __init__(self) -> None:
        self.loop = self


def test_what_an_idle_collection_froze_is_collected_by_the_next(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each idle collection freezes what is left (collections while rows decode skip it),
    after unfreezing and collecting what the last one froze: a cycle frozen with the
    engine's objects outlives a caller's ``gc.collect()`` only until the next one."""
    eng: Engine = make_engine(max_batch=4)
    request = TextRequest("warm up", SamplingParams(max_tokens=2))
    eng.submit(request).result(timeout=60)
    freezes: list[float] = []
    freeze = gc.freeze

    def counted() -> None:
        if threading.current_thread().name.startswith("mlx-engine"):
            freezes.append(time.monotonic())
        freeze()

    monkeypatch.setattr(gc, "freeze", counted)
    node = _Node()
    dead = weakref.ref(node)

    def idle_collection() -> None:
        done = len(freezes)
        eng.submit(request).result(timeout=60)
        wait_until(lambda: len(freezes) > done, timeout=10)

    idle_collection()  # frozen with the engine's objects
    del node
    gc.collect()
    assert dead() is not None  # frozen: the caller's collection skips it
    idle_collection()
    assert dead() is None
