"""What rank 0 tells the other ranks of a sharded engine: lane calls, as plain data.

A sharded engine runs its loop on rank 0 only. Every call that changes what a lane holds
or runs (``insert``, ``remove``, ``reset``) is queued as a ``LaneCall`` and sent, with
the ``step`` that follows it, as one ``Broadcast`` before rank 0 steps; a follower
performs exactly those calls on its own shard, in order, and nothing else. ``shutdown``
ends the followers. No mlx here: the bytes travel through ``engine.device.loading.collectives``.

The encoding is pickle of frozen dataclasses (LaneRow, SamplingParams, constraints):
the ranks of one group already trust each other with the model's activations.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Literal

from engine.config import EngineConfig
from engine.core.lane import LaneKind, LaneRow
from engine.requests.inbound.sampling import SamplingParams

LaneOp = Literal["insert", "remove", "reset", "step"]


@dataclass(frozen=True)
class LaneCall:
    """One lane method call on rank 0, to be repeated on every follower."""

    lane: LaneKind
    op: LaneOp
    rows: tuple[LaneRow, ...] = ()
    request_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Broadcast:
    """One message from rank 0: calls to perform in order, or the end of the engine."""

    calls: tuple[LaneCall, ...] = ()
    shutdown: bool = False


def encode(message: Broadcast) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Broadcast:
    message = pickle.loads(data)
    if not isinstance(message, Broadcast):
        raise TypeError(f"not a Broadcast: {type(message).__name__}")
    return message


def check_replicable(params: SamplingParams) -> None:
    """Refuse what a follower cannot repeat (raised on the caller's thread, at submit)."""
    if params.logits_processors:
        raise ValueError("logits_processors cannot run on a sharded engine: a Python "
                         "callable cannot be sent to the other ranks")


def heartbeat_seconds(config: EngineConfig) -> float:
    """How often an idle sharded engine sends an empty message to its followers."""
    return min(5.0, config.distributed_timeout / 2)


def follower_patience(config: EngineConfig) -> float:
    """Seconds a follower waits for rank 0's next message before it gives up."""
    return config.distributed_timeout + heartbeat_seconds(config)
