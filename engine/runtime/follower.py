"""The other ranks of a sharded engine: ``follow`` and ``distributed_rank``.

A sharded engine (``EngineConfig(shard="tensor" | "pipeline")``) runs its loop on rank 0
of the ``mx.distributed`` group; every other rank runs the same program and calls
``follow``, which loads that rank's shard and repeats rank 0's lane calls on it until
rank 0's engine closes::

    config = EngineConfig(shard="tensor")
    if engine.follow(MODEL, config):   # ranks 1..n-1: returns when rank 0 shuts down
        raise SystemExit(0)
    llm = Engine(MODEL, config)        # rank 0: the engine, as in one process
"""

from __future__ import annotations

import logging

from engine.config import EngineConfig, ModelSpec, checked_engine_args
from engine.core.lane import LaneKind
from engine.distributed.protocol import follower_patience
from engine.errors import EngineError
from engine.models import model_path_for
from engine.runtime.build import build_model

log = logging.getLogger("engine")


def distributed_rank() -> int:
    """This process's rank in the ``mx.distributed`` group (0 when not distributed)."""
    from engine.device.loading.collectives import rank

    return rank()


def follow(model: ModelSpec = None, config: EngineConfig | None = None, *,
           tokens: dict[int, list[int]] | None = None) -> bool:
    """Serve as a follower rank of a sharded engine; False at once on rank 0.

    On a non-zero rank this blocks, on the calling thread, until rank 0's engine is
    closed (then returns True), and raises if rank 0 goes away (its process ended) or
    this rank's shard failed. If rank 0 sends nothing for ``distributed_timeout`` plus
    its idle heartbeat (it stopped, or died inside a collective), the process ends with
    status 70: a thread blocked in a collective cannot be returned to. ``model`` and
    ``config`` must be those rank 0's ``Engine`` gets. Not sharded (``config.shard`` None,
    or one process) it returns False.
    ``tokens``, if given, is filled with the tokens this rank computed per request id
    (a check that the ranks agree: they should equal what rank 0's requests returned).
    """
    config = checked_engine_args(model, config)
    if config.shard is None:
        return False
    from engine.device.loading.collectives import init_group
    from engine.device.loading.loader import release_streams
    from engine.distributed.replay import follow_lanes

    group = init_group()
    if group.size() == 1 or group.rank() == 0:
        return False
    path = model_path_for(model, config.quantized)
    try:
        lanes = build_model(path, config, group).lanes  # what rank 0 builds, as a shard
        if lanes.channel is None:
            raise EngineError("the sharded model did not load as a shard")
        log.info("rank %d follows rank 0 (%s split)", group.rank(), config.shard)
        follow_lanes(lanes.channel, {kind: lanes.lane(kind) for kind in LaneKind}, tokens,
                     follower_patience(config))
    finally:
        release_streams()
    return True
