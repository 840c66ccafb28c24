"""The collectives a sharded engine needs from MLX: the group, and rank 0's byte channel.

A message travels as an ``all_sum`` of bytes to which every other rank contributes zeros:
one collective for a step, two when rows are admitted. What the bytes mean, the watchdog
and the replicated lanes are ``engine.distributed``'s; this module only moves bytes.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

Group = Any  # mx.distributed.Group



def init_group() -> Group:
    """The process's distributed group: ``MLX_HOSTFILE``/``MLX_RANK`` (ring), or size 1."""
    backend = os.environ.get("MLX_DISTRIBUTED_BACKEND", "ring" if os.environ.get(
        "MLX_HOSTFILE") else "any")
    return mx.distributed.init(backend=backend)


def rank() -> int:
    """This process's rank in the distributed group (0 when not distributed)."""
    return int(init_group().rank())


def collective_stream(stream: Any) -> Any:
    """Collectives run on the CPU: the engine's stream there, else the CPU device."""
    return stream if mx.default_device() == mx.cpu else mx.cpu


class Channel:
    """Rank 0 -> every rank: bytes through ``all_sum`` (the other ranks add zeros).

    The first collective carries a fixed 1 KiB block: the length and the message's start,
    which is all of a step's message; a longer one (admissions) sends the rest in a
    second ``all_sum``. mlx-lm's server sends the size, then the bytes: two collectives
    for every message.
    """

    FIRST = 1024

    def __init__(self, group: Group, stream: Any) -> None:
        self.group = group
        self.stream = collective_stream(stream)
        self.sent_bytes = 0
        self.messages = 0

    def _sum(self, value: mx.array) -> np.ndarray[Any, Any]:
        out = mx.distributed.all_sum(value, group=self.group, stream=self.stream)
        mx.eval(out)
        return np.array(out)

    def send(self, data: bytes) -> None:
        """Rank 0's side."""
        room = self.FIRST - 4
        head = np.zeros(self.FIRST, dtype=np.uint8)
        head[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
        first = np.frombuffer(data[:room], dtype=np.uint8)
        head[4: 4 + first.size] = first
        self._sum(mx.array(head))
        sent = self.FIRST
        if len(data) > room:
            self._sum(mx.array(np.frombuffer(data[room:], dtype=np.uint8)))
            sent += len(data) - room
        self.sent_bytes += sent
        self.messages += 1

    def receive(self) -> bytes:
        """A follower's side."""
        room = self.FIRST - 4
        head = self._sum(mx.zeros((self.FIRST,), dtype=mx.uint8))
        size = int.from_bytes(head[:4].tobytes(), "little")
        data = head[4: 4 + min(size, room)].tobytes()
        if size > room:
            data += self._sum(mx.zeros((size - room,), dtype=mx.uint8)).tobytes()
        return data

    def share_seed(self, seed: int) -> int:
        """Rank 0's seed on every rank (the others pass anything; it is ignored)."""
        mine = seed if self.group.rank() == 0 else 0
        return int(self._sum(mx.array([mine], dtype=mx.uint32))[0])
