"""Which embedding requests run together, and when (pure: no mlx, no threads).

Requests wait at most ``window`` seconds for company, or run at once when ``max_batch``
texts of one model are waiting. A batch holds requests of one embedding model, oldest
first, and never more than ``max_batch`` texts: a request with more is split into spans of
``max_batch`` texts that run one batch each (one per engine turn), so a 2048-text request
never holds the engine thread for more than one bounded batch; the rest of a split request
keeps its place at the head and is due at once. Cancelled and timed-out requests are
dropped here, with whatever of them has not run yet, and never reach the encoder again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from engine.embedding.request import EmbeddingRequest


@dataclass(frozen=True)
class Span:
    """Texts ``start:end`` of one request, run in one batch."""

    request: EmbeddingRequest
    start: int
    end: int

    @property
    def texts(self) -> tuple[str, ...]:
        return self.request.texts[self.start:self.end]

    @property
    def whole(self) -> bool:
        """The request's only span (it was not split)."""
        return self.start == 0 and self.last

    @property
    def last(self) -> bool:
        """The request's last span: once it has run, the request can finish."""
        return self.end == len(self.request.texts)


@dataclass
class EmbeddingBatch:
    """Spans of requests of one model that run in one encoder call."""

    model_key: Hashable
    spans: list[Span] = field(default_factory=list)

    @property
    def requests(self) -> list[EmbeddingRequest]:
        return [span.request for span in self.spans]

    @property
    def texts(self) -> list[str]:
        return [text for span in self.spans for text in span.texts]


@dataclass
class _Waiting:
    model_key: Hashable
    request: EmbeddingRequest
    taken: int = 0  # texts already handed out in batches (a split request's progress)

    @property
    def left(self) -> int:
        return len(self.request.texts) - self.taken


class EmbeddingBatcher:
    """Holds waiting requests; ``take(now)`` hands out the batch that is due, if any."""

    def __init__(self, window: float, max_batch: int) -> None:
        self.window = window
        self.max_batch = max_batch
        self._waiting: deque[_Waiting] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, model_key: Hashable, request: EmbeddingRequest) -> None:
        self._waiting.append(_Waiting(model_key, request))

    def due_at(self) -> float | None:
        """When the oldest request's window ends (the engine may sleep until then)."""
        if not self._waiting:
            return None
        oldest = self._waiting[0]
        if oldest.taken or self._texts_of(oldest.model_key) >= self.max_batch:
            return oldest.request.submitted_at  # already due (a split request goes on)
        return oldest.request.submitted_at + self.window

    def drop_finished(self, now: float) -> list[EmbeddingRequest]:
        """Remove cancelled, timed-out and otherwise finished requests; the dropped ones."""
        dropped: list[EmbeddingRequest] = []
        kept: deque[_Waiting] = deque()
        for waiting in self._waiting:
            request = waiting.request
            if request.expired(now) and not request.finished:
                request.time_out()
            if request.finished:
                dropped.append(request)
            else:
                kept.append(waiting)
        self._waiting = kept
        return dropped

    def discard(self, request: EmbeddingRequest) -> None:
        """Forget what is left of ``request`` (it failed or was cancelled while it ran)."""
        self._waiting = deque(w for w in self._waiting if w.request is not request)

    def take(self, now: float) -> EmbeddingBatch | None:
        """The due batch (oldest request's model, up to ``max_batch`` texts), or None."""
        due = self.due_at()
        if due is None or now < due:
            return None
        key = self._waiting[0].model_key
        batch = EmbeddingBatch(key)
        count = 0
        kept: deque[_Waiting] = deque()
        for waiting in self._waiting:
            room = self.max_batch - count
            # Whole requests fill the batch in order; only a first one too big is split.
            if waiting.model_key == key and room > 0 and (waiting.left <= room
                                                          or not batch.spans):
                end = waiting.taken + min(waiting.left, room)
                batch.spans.append(Span(waiting.request, waiting.taken, end))
                count += end - waiting.taken
                waiting.taken = end
                if waiting.left:
                    kept.append(waiting)  # the rest keeps its place, due at once
            else:
                kept.append(waiting)
        self._waiting = kept
        return batch

    def drain(self) -> list[EmbeddingRequest]:
        """Every waiting request, removed (the engine is going away)."""
        requests = [waiting.request for waiting in self._waiting]
        self._waiting.clear()
        return requests

    def _texts_of(self, key: Hashable) -> int:
        return sum(w.left for w in self._waiting if w.model_key == key)
