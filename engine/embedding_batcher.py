"""Which embedding requests run together, and when (pure: no mlx, no threads).

Requests wait at most ``window`` seconds for company, or run at once when ``max_batch``
texts of one model are waiting. A batch holds requests of one embedding model, oldest
first; a request is never split, so one with more than ``max_batch`` texts runs alone.
Cancelled and timed-out requests are dropped here and never reach the encoder.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from engine.embeddings import EmbeddingRequest


@dataclass
class EmbeddingBatch:
    """Requests of one model that run in one encoder call."""

    model_key: Hashable
    requests: list[EmbeddingRequest] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        return [text for request in self.requests for text in request.texts]


class EmbeddingBatcher:
    """Holds waiting requests; ``take(now)`` hands out the batch that is due, if any."""

    def __init__(self, window: float, max_batch: int) -> None:
        self.window = window
        self.max_batch = max_batch
        self._waiting: deque[tuple[Hashable, EmbeddingRequest]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, model_key: Hashable, request: EmbeddingRequest) -> None:
        self._waiting.append((model_key, request))

    def due_at(self) -> float | None:
        """When the oldest request's window ends (the engine may sleep until then)."""
        if not self._waiting:
            return None
        key, oldest = self._waiting[0]
        if self._texts_of(key) >= self.max_batch:
            return oldest.submitted_at  # already due
        return oldest.submitted_at + self.window

    def drop_finished(self, now: float) -> list[EmbeddingRequest]:
        """Remove cancelled, timed-out and otherwise finished requests; the dropped ones."""
        dropped: list[EmbeddingRequest] = []
        kept: deque[tuple[Hashable, EmbeddingRequest]] = deque()
        for key, request in self._waiting:
            if request.expired(now) and not request.finished:
                request.time_out()
            if request.finished:
                dropped.append(request)
            else:
                kept.append((key, request))
        self._waiting = kept
        return dropped

    def take(self, now: float) -> EmbeddingBatch | None:
        """The due batch (oldest request's model, up to ``max_batch`` texts), or None."""
        due = self.due_at()
        if due is None or now < due:
            return None
        key = self._waiting[0][0]
        batch = EmbeddingBatch(key)
        count = 0
        kept: deque[tuple[Hashable, EmbeddingRequest]] = deque()
        for other, request in self._waiting:
            fits = not batch.requests or count + len(request.texts) <= self.max_batch
            if other == key and fits and count < self.max_batch:
                batch.requests.append(request)
                count += len(request.texts)
            else:
                kept.append((other, request))
        self._waiting = kept
        return batch

    def drain(self) -> list[EmbeddingRequest]:
        """Every waiting request, removed (the engine is going away)."""
        requests = [request for _, request in self._waiting]
        self._waiting.clear()
        return requests

    def _texts_of(self, key: Hashable) -> int:
        return sum(len(r.texts) for k, r in self._waiting if k == key)
