"""Unloading an idle engine's chat model (``EngineConfig.keep_alive``), on the engine thread.

``unload`` takes an idle composition apart: stored prefixes go to the disk writer (the
disk tier stays), the memory store is emptied, the grammar compiler forgets its compiled
matchers, and what the next load reuses is ``Kept``, none of it an array of the model.
Dropping the rest (weights, lanes, the mlx-lm generator and its caches) is the caller's:
once nothing references them, ``release_memory`` frees what they held and reads the
figures then.
"""

from __future__ import annotations

import gc
from typing import Any

from engine.core.memory import resident_bytes
from engine.runtime.build import Composition, Kept


def unload(composition: Composition) -> Kept:
    """What the next load of this (idle) composition's model reuses; the rest may go."""
    built = composition.built
    tiers = built.lanes.unload()
    built.preparer.compiler.clear_compiled()
    return Kept(built.preparer, tiers, built.model.stream)


def release_memory() -> dict[str, Any]:
    """Free what an unloaded model held once nothing references it; the memory figures.

    mlx-lm's finished batches sit in reference cycles that pin their arrays until the
    cyclic GC runs, so collect first; then MLX's buffer cache would keep the freed weights
    for reuse and glibc's arenas the freed pages: both are given back.
    """
    from engine.device.loading.memory import device_memory, release_free_memory

    collect_cycles()
    release_free_memory()
    active, cached = device_memory()
    return {"mlx_active_bytes": active, "mlx_cache_bytes": cached,
            "resident_bytes": resident_bytes()}


def collect_cycles() -> None:
    """Collect every reference cycle, then freeze what is left (``gc.freeze``).

    Python's collection of its oldest generation scans every tracked object: with mlx-vlm
    imported that is over 100k, 60-120 ms in which the engine thread, and every row
    decoding, waited (one every few seconds while text rows decoded beside images,
    measured). What is alive once the engine is idle (its model, tokenizer, imports) lives
    as long as it does: frozen, the collections while rows decode scan only what came
    since. Unfrozen first, so a cycle that became garbage since the last freeze is
    collected here: nothing frozen outlives the next idle collection, the process's other
    objects (frozen with the engine's) included.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def freeze_live() -> None:
    """Freeze what is alive now, without a collection first: what a load (or the first
    image's tower) built lives as long as the model, and a full collection to find its
    garbage costs 60-120 ms in a process with the vision stack imported (every engine
    start paid it). The next idle collection (``collect_cycles``) unfreezes and collects."""
    gc.freeze()
