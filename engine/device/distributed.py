"""A sharded engine's collectives: the group, rank 0's broadcast, the follower loop.

Rank 0 wraps its lanes in ``ReplicatedLane``: ``insert``/``remove``/``reset`` are queued
and sent with the next ``step`` as one message (``engine.replication.Broadcast``), then
the call runs locally. A message travels as an ``all_sum`` of bytes to which every other
rank contributes zeros: one collective for a step, two when rows are admitted. ``follow_lanes``
repeats each message's calls on a follower's own lanes until ``shutdown``.

A collective a peer never joins blocks forever, so rank 0 runs a watchdog: a broadcast
plus the step after it that takes longer than ``distributed_timeout`` makes the engine
dead (``on_hang``) while the engine thread is still stuck. A peer whose process ended
makes the ring raise at once ("connection to a peer was lost").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import EngineDeadError
from engine.lane import Lane, LaneRow, LaneStep
from engine.replication import Broadcast, LaneCall, LaneName, decode, encode

log = logging.getLogger("engine")
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


class Link:
    """Rank 0's end: queued lane calls, the broadcast, and the watchdog on collectives."""

    def __init__(self, channel: Channel, timeout: float,
                 on_hang: Callable[[EngineDeadError], None] | None) -> None:
        self.channel = channel
        self.timeout = timeout
        self.broken = False
        self.lock = threading.Lock()
        self.broadcast_seconds = 0.0
        self._pending: list[LaneCall] = []
        self._last_sent = time.monotonic()
        self._on_hang = on_hang
        self._busy_since: float | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="mlx-engine-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def silent_for(self) -> float:
        """Seconds since the followers last heard from rank 0."""
        return time.monotonic() - self._last_sent

    def queue(self, call: LaneCall) -> None:
        self._pending.append(call)

    def begin(self, step: LaneCall) -> None:
        """Send the queued calls and ``step``; the watchdog times this until ``end``."""
        self.broadcast_seconds += self._send(step)

    def heartbeat(self) -> None:
        """An empty message while idle: a follower that is gone is found now, not at the
        next request (the queued calls, if any, go with it)."""
        self._send()
        self.end()

    def _send(self, *calls: LaneCall) -> float:
        """Broadcast the queued calls, then ``calls``, under the watchdog; seconds sending."""
        self._check()
        message, self._pending = Broadcast((*self._pending, *calls)), []
        with self._wake:
            self._busy_since = time.monotonic()
            self._wake.notify()
        started = time.perf_counter()
        try:
            self.channel.send(encode(message))
        except Exception as exc:
            self._fail(exc)
        self._last_sent = time.monotonic()
        return time.perf_counter() - started

    def end(self) -> None:
        with self._wake:
            self._busy_since = None
        with self.lock:  # the watchdog may have given up on this step meanwhile
            self._check()

    def _check(self) -> None:
        if self.broken:
            raise EngineDeadError("a rank of the sharded engine stopped answering")

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        raise EngineDeadError(f"a collective of the sharded engine failed: {exc!r}") from exc

    def step_failed(self, exc: BaseException) -> None:
        """Any failed step is fatal when sharded: the ranks may no longer agree."""
        with self._wake:
            self._busy_since = None
        self._fail(exc)

    def shutdown(self) -> None:
        """Tell the followers to stop (best effort: never after a failure)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self.broken:
            return
        self.broken = True  # nothing is sent after this
        try:
            self.channel.send(encode(Broadcast(shutdown=True)))
        except Exception:
            log.exception("telling the followers to stop failed")

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                since = self._busy_since
                if since is None:
                    self._wake.wait()
                    continue
                left = since + self.timeout - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._busy_since = None
                self._hang()

    def _hang(self) -> None:
        with self.lock:
            if self.broken:
                return
            self.broken = True
            error = EngineDeadError(f"a rank of the sharded engine did not answer within "
                                    f"{self.timeout:g} s")
            log.error("%s", error)
            if self._on_hang is not None:
                self._on_hang(error)


class ReplicatedLane:
    """Rank 0's lane: every call is repeated on each follower's lane; implements ``Lane``."""

    def __init__(self, name: LaneName, lane: Lane, link: Link) -> None:
        self.name: LaneName = name
        self.inner = lane
        self._link = link

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


def follow_lanes(channel: Channel, lanes: dict[LaneName, Lane],
                 tokens: dict[int, list[int]] | None = None,
                 patience: float | None = None) -> None:
    """A follower's loop: perform rank 0's calls on these lanes until it shuts down.

    ``tokens``, if given, gets the tokens this rank's lanes produced per request id (what
    rank 0 published, when the ranks agree). ``patience``: seconds without a message
    from rank 0 (which sends one at least every heartbeat) after which this process ends
    with status 70, since a thread inside a collective cannot be called back.
    """
    alive = _Patience(patience) if patience is not None else None
    try:
        _follow(channel, lanes, tokens, alive)
    finally:
        if alive is not None:
            alive.stop()


class _Patience:
    """Ends a follower process whose rank 0 went silent (stopped, or gone mid-collective)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="mlx-follower-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            if time.monotonic() - self.last > self.seconds:
                log.error("rank 0 sent nothing for %.3g s: this follower ends", self.seconds)
                logging.shutdown()
                os._exit(70)

    def stop(self) -> None:
        self._stop.set()


def _follow(channel: Channel, lanes: dict[LaneName, Lane],
            tokens: dict[int, list[int]] | None, alive: _Patience | None) -> None:
    while True:
        message = decode(channel.receive())
        if alive is not None:
            alive.last = time.monotonic()
        if message.shutdown:
            for lane in lanes.values():
                lane.reset()
            return
        for call in message.calls:
            lane = lanes[call.lane]
            if call.op == "insert":
                lane.insert(call.rows)
            elif call.op == "remove":
                lane.remove(call.request_ids)
            elif call.op == "reset":
                lane.reset()
            else:
                step = lane.step()  # results are rank 0's to publish
                if alive is not None:
                    alive.last = time.monotonic()
                if tokens is not None:
                    for token in step.tokens:
                        tokens.setdefault(token.request_id, []).append(token.token)
