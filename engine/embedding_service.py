"""The engine thread's embedding work: batch the waiting requests, run the due batch.

Owned by the engine thread (``run_due`` runs MLX through ``engine.device.encoder``); the
engine calls it between its decode steps, one batch per turn, so a generating row only
waits one bounded batch (``embed_max_batch`` texts) and its tokens are not touched.
While rows decode, the encoder earns time with their steps and gets at most ``share`` of
the thread (a batch runs when the earned time is positive, then pays what it took), so a
steady embedding load cannot starve decoding. Encoders load lazily, on the engine thread,
the first time their model is asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.embedding_batcher import EmbeddingBatch, EmbeddingBatcher
from engine.embeddings import EmbeddingRequest, Embeddings

if TYPE_CHECKING:
    from engine.device.encoder import Encoder

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


class EmbeddingService:
    """Waiting requests and loaded encoders of one engine (engine thread only)."""

    def __init__(self, window: float, max_batch: int, share: float = 1.0, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` times encoder calls (a test seam)."""
        self.batcher = EmbeddingBatcher(window, max_batch)
        self.counters = EmbeddingCounters()
        self.share = share
        self._clock = clock
        self._credit = 0.0  # encoder seconds earned by decode steps, less those spent
        self._last_batch = 0.0
        self._encoders: dict[Path, Encoder] = {}

    @property
    def pending(self) -> int:
        return len(self.batcher)

    def add(self, request: EmbeddingRequest) -> None:
        self.batcher.add(request.model_path, request)

    def due_at(self) -> float | None:
        return self.batcher.due_at()

    def run_due(self, step_seconds: float = 0.0) -> float:
        """Drop cancelled requests, run at most one due batch; the seconds it took.

        ``step_seconds``: the decode steps of this turn (0 when no row decodes).
        """
        now = time.monotonic()
        self.counters.cancelled += len(self.batcher.drop_finished(now))
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

    def _run(self, batch: EmbeddingBatch) -> None:
        requests = [r for r in batch.requests if not r.finished]
        self.counters.cancelled += len(batch.requests) - len(requests)
        if not requests:
            return
        texts = [text for request in requests for text in request.texts]
        try:
            encoded = self._encoder(requests[0].model_path).encode(texts)
        except Exception as exc:  # this batch's requests fail; the engine goes on
            log.error("embedding batch failed: %r", exc)
            for request in requests:
                self.counters.failed += request.finish(error=exc)
            return
        self.counters.batches += 1
        self.counters.peak_batch_texts = max(self.counters.peak_batch_texts, len(texts))
        start = 0
        for request in requests:
            end = start + len(request.texts)
            result = Embeddings(encoded.vectors[start:end], sum(encoded.lengths[start:end]),
                                request.model_name)
            if request.finish(result):
                self.counters.requests += 1
                self.counters.texts += end - start
                self.counters.tokens += result.prompt_tokens
            else:  # cancelled or timed out while it ran: its vectors are dropped
                self.counters.cancelled += 1
            start = end

    def _encoder(self, path: Path) -> Encoder:
        encoder = self._encoders.get(path)
        if encoder is None:
            from engine.device.encoder import Encoder

            log.info("loading embedding model %s", path)
            encoder = self._encoders[path] = Encoder(path)
        return encoder
