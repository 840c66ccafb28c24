"""The engine thread's embedding work: batch the waiting requests, run the due batch.

Owned by the engine thread (``run_due`` runs MLX through ``engine.device.embedding.encoder``); the
engine calls it between its decode steps, one batch per turn, so a generating row only
waits one bounded batch (``embed_max_batch`` texts) and its tokens are not touched. A
request with more texts runs as several batches, one per turn; its vectors are gathered
here and it finishes with the last one (cancelled in between, the rest never runs).
While rows decode, the encoder earns time with their steps and gets at most ``share`` of
the thread (a batch runs when the earned time is positive, then pays what it took), so a
steady embedding load cannot starve decoding. Encoders load lazily, on the engine thread,
the first time their model is asked for.

The one exception to engine-thread ownership is ``register``/``fail_registered``: they keep
their own lock, so a thread that cannot wait for the engine thread (the sharded watchdog,
while the engine thread is stuck in a collective) can fail every unfinished request
without touching the batcher.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.embedding.batcher import EmbeddingBatch, EmbeddingBatcher, Span
from engine.embedding.request import EmbeddingRequest, Embeddings

if TYPE_CHECKING:
    from engine.device.embedding.encoder import Encoder

log = logging.getLogger("engine")


@dataclass
class EmbeddingCounters:
    """What the service has done; the engine copies these into ``EngineStats``."""

    requests: int = 0  # finished with vectors
    texts: int = 0
    tokens: int = 0
    batches: int = 0
    peak_batch_texts: int = 0
    cancelled: int = 0  # cancelled or timed out: skipped, or their vectors dropped
    failed: int = 0
    seconds: float = 0.0  # in encoder calls, on the engine thread


@dataclass
class _Progress:
    """The vectors of a split request's spans run so far, in order."""

    parts: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0


class EmbeddingService:
    """Waiting requests and loaded encoders of one engine (engine thread only, but for
    ``register``/``fail_registered``, which any thread may call)."""

    def __init__(self, window: float, max_batch: int, share: float = 1.0, *,
                 clock: Callable[[], float] = time.perf_counter,
                 now: Callable[[], float] = time.monotonic,
                 before_encode: Callable[[list[str]], None] | None = None,
                 load_encoder: Callable[[Path], Encoder] | None = None) -> None:
        """``clock`` times encoder calls, ``now`` is the requests' time (test seams);
        ``before_encode(texts)`` runs just before each batch is encoded (``StepProbe``);
        ``load_encoder(path)`` loads a model's encoder (default:
        ``engine.device.embedding.encoder``; anything with ``encode(texts)`` and ``nbytes``,
        so tests run without mlx)."""
        self.batcher = EmbeddingBatcher(window, max_batch)
        self.counters = EmbeddingCounters()
        self.share = share
        self._clock = clock
        self._now = now
        self._progress: dict[EmbeddingRequest, _Progress] = {}  # split requests, part-run
        # Every request handed to this service that may still be unfinished; any thread.
        self._registered: weakref.WeakSet[EmbeddingRequest] = weakref.WeakSet()
        self._registered_lock = threading.Lock()
        self._credit = 0.0  # encoder seconds earned by decode steps, less those spent
        self._last_batch = 0.0
        self._encoders: dict[Path, Encoder] = {}
        self._before_encode = before_encode
        self._load_encoder = load_encoder

    @property
    def weights_bytes(self) -> int:
        """Bytes of the embedding models loaded so far (engine thread)."""
        return sum(encoder.nbytes for encoder in self._encoders.values())

    @property
    def pending(self) -> int:
        return len(self.batcher)

    @property
    def part_run(self) -> int:
        """Split requests with some of their chunks run and the rest still to run."""
        return len(self._progress)

    def add(self, request: EmbeddingRequest) -> None:
        self.batcher.add(request.model_path, request)

    def register(self, request: EmbeddingRequest) -> None:
        """Note a request on its way to this service (any thread; see ``fail_registered``)."""
        with self._registered_lock:
            self._registered.add(request)

    def fail_registered(self, error: BaseException) -> int:
        """Finish every registered unfinished request with ``error``; how many it finished.

        Safe from any thread: it only finishes requests (each has its own lock) and never
        touches the batcher or the counters, which stay the engine thread's. A request that
        later reaches the engine thread is found finished there and skipped.
        """
        with self._registered_lock:
            requests = list(self._registered)
            self._registered.clear()
        return sum(request.finish(error=error) for request in requests)

    def due_at(self) -> float | None:
        return self.batcher.due_at()

    def run_due(self, step_seconds: float = 0.0) -> float:
        """Drop cancelled requests, run at most one due batch; the seconds it took.

        ``step_seconds``: the decode steps of this turn (0 when no row decodes).
        """
        now = self._now()
        for request in self.batcher.drop_finished(now):
            self._progress.pop(request, None)  # a split request's spans so far are dropped
            self.counters.cancelled += request.cancelled  # else failed by whoever finished it
        decoding = step_seconds > 0 and self.share < 1.0
        if decoding:
            earned = self._credit + step_seconds * self.share / (1.0 - self.share)
            self._credit = min(earned, max(self._last_batch, step_seconds))  # save little
            if self._credit <= 0:
                return 0.0  # decoding keeps the thread until the encoder has earned a turn
        else:
            self._credit = 0.0
        batch = self.batcher.take(now)
        if batch is None:
            return 0.0
        started = self._clock()
        self._run(batch)
        seconds = self._clock() - started
        self.counters.seconds += seconds
        self._last_batch = seconds
        if decoding:
            self._credit -= seconds
        return seconds

    def fail_all(self, error: BaseException) -> None:
        """Finish every waiting request with ``error`` (the engine is closing or dead)."""
        for request in self.batcher.drain():
            if request.finish(error=error):
                self.counters.failed += 1
        self._progress.clear()

    def _run(self, batch: EmbeddingBatch) -> None:
        spans = [span for span in batch.spans if not span.request.finished]
        for span in batch.spans:
            if span.request.finished:  # cancelled since ``take``: skipped unrun
                self._forget(span)
                self.counters.cancelled += 1
        if not spans:
            return
        texts = [text for span in spans for text in span.texts]
        try:
            encoder = self._encoder(spans[0].request.model_path)
            if self._before_encode is not None:
                self._before_encode(texts)
            encoded = encoder.encode(texts)
        except Exception as exc:  # this batch's requests fail; the engine goes on
            log.error("embedding batch failed: %r", exc)
            for span in spans:
                self._forget(span)
                self.counters.failed += span.request.finish(error=exc)
            return
        self.counters.batches += 1
        self.counters.peak_batch_texts = max(self.counters.peak_batch_texts, len(texts))
        start = 0
        for span in spans:
            end = start + span.end - span.start
            vectors, tokens = encoded.vectors[start:end], sum(encoded.lengths[start:end])
            start = end
            request = span.request
            if request.finished:  # cancelled or timed out while it ran: vectors dropped
                self._forget(span)
                self.counters.cancelled += 1
                continue
            if not span.whole:  # one span of a split request: gather, finish with the last
                progress = self._progress.setdefault(request, _Progress())
                progress.parts.append(vectors)
                progress.tokens += tokens
                if not span.last:
                    continue
                del self._progress[request]
                vectors, tokens = np.concatenate(progress.parts), progress.tokens
            if request.finish(Embeddings(vectors, tokens, request.model_name)):
                self.counters.requests += 1
                self.counters.texts += len(request.texts)
                self.counters.tokens += tokens
            else:  # cancelled between the check above and now
                self.counters.cancelled += 1

    def _forget(self, span: Span) -> None:
        """Drop what ran of the span's request and what of it still waits: it will not
        finish here, so its remaining spans must not run."""
        self._progress.pop(span.request, None)
        if not span.last:
            self.batcher.discard(span.request)

    def _encoder(self, path: Path) -> Encoder:
        encoder = self._encoders.get(path)
        if encoder is None:
            log.info("loading embedding model %s", path)
            if self._load_encoder is not None:
                encoder = self._load_encoder(path)
            else:
                from engine.device.embedding.encoder import Encoder

                encoder = Encoder(path)
            self._encoders[path] = encoder
        return encoder
