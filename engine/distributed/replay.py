"""A follower's loop: rank 0's lane calls, performed on this rank's own lanes.

``follow_lanes`` repeats each message's calls until rank 0 sends ``shutdown``; a rank 0
that goes silent ends the follower's process (a thread inside a collective cannot be
called back).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from engine.core.lane import Lane, LaneKind
from engine.device.loading.collectives import Channel
from engine.distributed.protocol import decode

log = logging.getLogger("engine")


def follow_lanes(channel: Channel, lanes: dict[LaneKind, Lane],
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


def _follow(channel: Channel, lanes: dict[LaneKind, Lane],
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
