"""The distributed group rank 0's engine runs on, from the config and the environment."""

from __future__ import annotations

import logging
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError

log = logging.getLogger("engine")


def shard_group(config: EngineConfig) -> Any:
    """The distributed group a sharded engine runs on (rank 0 only); None when not sharded."""
    if config.shard is None:
        return None
    from engine.device.loading.collectives import init_group

    group = init_group()
    if group.size() == 1:
        log.warning("shard=%r but this process is not part of a distributed group "
                    "(MLX_HOSTFILE and MLX_RANK): running unsharded", config.shard)
        return None
    if group.rank() != 0:
        raise EngineError(f"rank {group.rank()} of a sharded engine follows rank 0: call "
                          f"engine.follow(model, config) there instead of using an Engine")
    return group
