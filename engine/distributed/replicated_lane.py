"""Rank 0's lanes, replicated: every call is repeated on each follower's own lane."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.lane import Lane, LaneKind, LaneRow, LaneStep
from engine.device.loading.loader import Lanes
from engine.distributed.link import Link
from engine.distributed.protocol import LaneCall
from engine.errors import EngineDeadError


class ReplicatedLane:
    """Rank 0's lane: every call is repeated on each follower's lane; implements ``Lane``."""

    def __init__(self, name: LaneKind, lane: Lane, link: Link) -> None:
        self.name = name
        self.inner = lane
        self._link = link

    def accepts(self, row: LaneRow) -> str | None:
        return self.inner.accepts(row)  # the same model on every rank: decided here alone

    def insert(self, rows: Sequence[LaneRow]) -> None:
        self._link.queue(LaneCall(self.name, "insert", rows=tuple(rows)))
        self.inner.insert(rows)

    def remove(self, request_ids: Sequence[int]) -> None:
        self._link.queue(LaneCall(self.name, "remove", request_ids=tuple(request_ids)))
        self.inner.remove(request_ids)

    def reset(self) -> list[int]:
        if not self._link.broken:
            self._link.queue(LaneCall(self.name, "reset"))
        return self.inner.reset()

    def step(self) -> LaneStep:
        self._link.begin(LaneCall(self.name, "step"))
        try:
            result = self.inner.step()
        except Exception as exc:
            self._link.step_failed(exc)
            raise  # not reached: step_failed raises
        self._link.end()
        return result

    def __len__(self) -> int:
        return len(self.inner)


def replicate(lanes: Lanes, timeout: float,
              on_hang: Callable[[EngineDeadError], None] | None = None) -> Link:
    """Rank 0: the loop drives ``lanes`` through replicated lanes; the link to the others."""
    assert lanes.channel is not None, "replicate needs a sharded model's lanes"
    link = Link(lanes.channel, timeout, on_hang)
    lanes.replicated = {kind: ReplicatedLane(kind, lanes.lane(kind), link)
                        for kind in LaneKind}
    return link
