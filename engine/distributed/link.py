"""Rank 0's end of a sharded engine: queued lane calls, the broadcast, the watchdog.

Rank 0's lanes queue ``insert``/``remove``/``reset`` here; they are sent with the next
``step`` as one message (``engine.distributed.protocol.Broadcast``).
A collective a peer never joins blocks forever, so a watchdog thread makes the engine
dead (``on_hang``) when a broadcast plus the step after it takes longer than
``distributed_timeout``, while the engine thread is still stuck. A peer whose process
ended makes the ring raise at once ("connection to a peer was lost").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.device.loading.collectives import Channel
from engine.distributed.protocol import Broadcast, LaneCall, encode
from engine.errors import EngineDeadError

log = logging.getLogger("engine")


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
