"""The one place a loaded model is composed: weights, request preparation, lanes, the core.

``build_model`` is what every rank of an engine builds (rank 0 and a sharded engine's
followers alike): the model loaded on this thread, its ``Preparer`` and its lanes.
``compose_core`` adds what only rank 0 runs: the followers' link, the scheduler and the
step core. Runs on the engine thread (or a follower's), which owns all MLX work.

After keep_alive unloaded a model (``engine.runtime.unload``), ``build_model`` builds it
again from what the unload ``Kept``: only the weights are read and the lanes rebuilt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.scheduler import BatchMode, Scheduler
from engine.core.stats import StatsBook
from engine.core.step_core import StepCore
from engine.core.step_probe import StepProbe
from engine.errors import EngineDeadError
from engine.models import config_context_limit
from engine.requests.prepare import Preparer

if TYPE_CHECKING:
    from engine.device.loading.collectives import Group
    from engine.device.loading.loader import Lanes, LoadedModel, PrefixTiers
    from engine.distributed.link import Link

log = logging.getLogger("engine")


@dataclass
class BuiltModel:
    """A model loaded on this thread, with what prepares its requests and runs its rows."""

    model: LoadedModel
    preparer: Preparer
    lanes: Lanes


@dataclass
class Kept:
    """What an unloaded model leaves for its next load, none of it the model's arrays: the
    preparer (tokenizer, prompt renderer, the grammar compiler's vocabulary), the prefix
    store (emptied) with its disk tier, and the engine thread's MLX stream."""

    preparer: Preparer
    tiers: PrefixTiers
    stream: Any

    def close(self) -> None:
        """The engine is going away unloaded: finish writing prefixes to disk."""
        if self.tiers.disk is not None:
            self.tiers.disk.close()


@dataclass
class Composition:
    """Rank 0's whole engine once loaded: the model, the core that drives its lanes, and
    the link to the followers of a sharded engine."""

    built: BuiltModel
    scheduler: Scheduler
    core: StepCore
    link: Link | None = None


def build_model(path: Path, config: EngineConfig, group: Group | None,
                kept: Kept | None = None) -> BuiltModel:
    """Load ``path`` on this thread (a shard of it with ``group``) and build its lanes.

    Every rank of a sharded engine calls this at the same time: loading runs the model's
    collectives. ``kept``: what an unload of this model kept (a reload: weights only).
    """
    from engine.device.loading.loader import build_lanes, load_model

    limit = config_context_limit(path)
    if kept is None:
        model = load_model(path, config, group, limit)
        preparer = Preparer(model.tokenizer, path, model.vocab_size, config.json_string_ngram)
        return BuiltModel(model, preparer, build_lanes(model, config, preparer.compiler,
                                                       vision_format=preparer.vision))
    model = load_model(path, config, group, limit, tokenizer=kept.preparer.tokenizer,
                       stream=kept.stream)
    return BuiltModel(model, kept.preparer,
                      build_lanes(model, config, kept.preparer.compiler, kept.tiers,
                                  vision_format=kept.preparer.vision))


def compose_core(built: BuiltModel, config: EngineConfig, book: StatsBook,
                 probe: StepProbe | None,
                 on_hang: Callable[[EngineDeadError], None]) -> Composition:
    """Rank 0's loop over a built model: the scheduler, the step core, and (sharded) the
    link that replicates each lane call to the followers; the first stats are written."""
    lanes = built.lanes
    link = None
    if lanes.channel is not None:  # rank 0 of a sharded engine
        from engine.distributed.replicated_lane import replicate

        link = replicate(lanes, config.distributed_timeout, on_hang=on_hang)
    store = lanes.store
    bounds = built.model.bounds  # the settings' "auto" values resolved for this machine
    # Cached prefixes count against the KV budget and are the first thing to give way.
    scheduler = Scheduler(built.model.footprint, config.max_batch,
                          bounds.kv_budget_bytes or None,
                          cache_bytes=lambda: store.nbytes, reclaim=store.shrink_to)
    core = StepCore(scheduler, lanes.lane, built.preparer, book,
                    prefix_bytes=lambda: store.nbytes,
                    max_consecutive_failures=config.max_consecutive_step_failures,
                    probe=probe)
    book.set(kv_budget_bytes=bounds.kv_budget_bytes, prefix_cache_limit_bytes=store.max_bytes,
             buffer_cache_limit_bytes=bounds.buffer_cache_bytes, loaded=True,
             batch_mode=scheduler.mode.value, context_limit=built.model.footprint.context_limit,
             cache_kinds=lanes.batch.cache_kinds, kv_bits=config.kv_bits or 0,
             kv_bytes_per_token=built.model.footprint.bytes_for(1)
             - built.model.footprint.bytes_for(0),
             speedups=lanes.speedups(serial=scheduler.mode is BatchMode.SERIAL),
             **built.model.weights.stats())
    if scheduler.mode is BatchMode.SERIAL:
        log.warning("model caches (%s) cannot batch: requests run one at a time",
                    ", ".join(built.model.footprint.non_batchable_kinds))
    return Composition(built, scheduler, core, link)
