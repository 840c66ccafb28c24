"""What callers on any thread send the engine thread, and the queue that carries it.

Callers only enqueue commands; the engine thread takes them at each step boundary. On an
idle engine the first submit may wait a short admission window for more to join it, so a
burst starts as one prefill group instead of its first row alone.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass

from engine.core.rows import Row
from engine.embedding.request import EmbeddingRequest


@dataclass(frozen=True)
class Submit:
    row: Row
    # Seconds the chat model should stay loaded once idle after this request (None: keep
    # it); the engine's configured value unless the request set its own.
    keep_alive: float | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Embed:
    request: EmbeddingRequest


@dataclass(frozen=True)
class WantChat:
    """Wakes a thread serving only embeddings: the chat model is wanted now."""


Command = Submit | Cancel | Shutdown | Embed | WantChat


class CommandQueue:
    """A thread-safe queue of commands, plus those one loop left for the next (``hold``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._held: list[Command] = []  # engine thread only

    def put(self, command: Command) -> None:
        """From any thread."""
        self._queue.put(command)

    def hold(self, command: Command) -> None:
        """Leave a command for the next call of ``take`` (the embeddings-only loop leaves
        chat commands for the chat loop, in order)."""
        self._held.append(command)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @property
    def waiting(self) -> bool:
        """Whether a command is held or queued (engine thread: the queue may grow meanwhile,
        never shrink)."""
        return bool(self._held) or not self._queue.empty()

    def take(self, block: bool, wait: float | None = None, *, window: float = 0.0,
             burst: int = 1) -> list[Command]:
        """Every command there is: those held first, then the queue's. ``block``: wait up to
        ``wait`` seconds (None: forever) for a first one; if it is a submit, wait up to
        ``window`` more for submits to join it, until ``burst`` of them have come."""
        commands, self._held = self._held, []
        if block and not commands:
            try:
                commands.append(self._queue.get(timeout=wait))
            except queue.Empty:
                return commands
            if isinstance(commands[0], Submit) and window > 0:
                self._gather(commands, window, burst)
        while True:
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                return commands

    def _gather(self, commands: list[Command], window: float, burst: int) -> None:
        deadline = time.monotonic() + window
        submits = 1
        while submits < burst:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                command = self._queue.get(timeout=left)
            except queue.Empty:
                return
            commands.append(command)
            if isinstance(command, Shutdown):
                return
            submits += isinstance(command, Submit)

    def drain(self) -> Iterator[Command]:
        """Every command left, held ones first (the engine is going away)."""
        held, self._held = self._held, []
        yield from held
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
