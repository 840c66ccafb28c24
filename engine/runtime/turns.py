"""One turn of the loaded engine's loop, and what it does between turns.

    take     commands: accepted rows and cancellations to the step core, embeddings queued
    turn     core.turn()  (plan -> step -> update -> publish, engine/core/step_core.py)
    embed    at most one due embedding batch, between steps, never beside one
    stats    the turn's figures, written in one place (StatsBook)

Between turns: how long an idle loop may sleep (the nearest deadline, the followers'
heartbeat, an embedding window, the keep_alive unload) and the collection once nothing
runs.
"""

from __future__ import annotations

import time
from typing import Any

from engine.config import EngineConfig
from engine.core.keep_alive import KeepAlive
from engine.core.memory import ResidentSampler
from engine.core.scheduler import BatchMode
from engine.core.stats import StatsBook
from engine.core.step_probe import StepProbe, TurnReport
from engine.distributed.protocol import heartbeat_seconds
from engine.embedding.service import EmbeddingService
from engine.runtime.build import Composition
from engine.runtime.commands import Cancel, Command, Embed, Submit
from engine.runtime.unload import collect_cycles, freeze_live

# Seconds with nothing to run before finished batches' cycles are collected (the next turn
# of a sequential agent arrives sooner and must not wait for a full collection).
IDLE_COLLECT_SECONDS = 0.25


class Turns:
    """The loop of a loaded engine, one turn at a time (engine thread only)."""

    def __init__(self, composition: Composition, config: EngineConfig, book: StatsBook,
                 embeddings: EmbeddingService, probe: StepProbe | None,
                 keep_alive: KeepAlive) -> None:
        self.composition = composition
        self._config = config
        self._book = book
        self._embeddings = embeddings
        self._probe = probe
        self._keep_alive = keep_alive
        bounds = composition.built.model.bounds
        self._chat_weights, self._chat_bound = bounds.weights_bytes, bounds.resident_bound
        self._book.set(**self.weights())
        self._started = 0.0  # when the current turn took its commands
        self._speedups_version = -1
        self._resident = ResidentSampler()
        self._idle_since: float | None = None  # rows ended and none since: the collection's clock
        self._tower_frozen = False  # the vision tower, once built, frozen (``freeze_live``)

    @property
    def idle(self) -> bool:
        """Nothing runs or waits: the loop may block on the queue."""
        return self.composition.scheduler.is_idle()

    def take(self, commands: list[Command]) -> None:
        """Hand the turn's commands to the core (submits, cancels) and the embeddings."""
        self._started = time.perf_counter()
        core = self.composition.core
        for command in commands:
            if isinstance(command, Submit):
                self._keep_alive.ask(command.keep_alive)  # the latest request's applies
                core.accept(command.row)
            elif isinstance(command, Cancel):
                core.cancel(command.request_id)
            elif isinstance(command, Embed):
                self._embeddings.add(command.request)

    def heartbeat_if_due(self) -> None:
        """Idle and sharded: tell the followers rank 0 is alive (raises if one is gone)."""
        link = self.composition.link
        if link is not None and link.silent_for() >= heartbeat_seconds(self._config):
            link.heartbeat()

    def turn(self) -> None:
        """The core's turn, then at most one due embedding batch, then the stats."""
        used = not self.idle
        turn = self.composition.core.turn()
        if used:  # the keep_alive clock starts again after the last turn that ran rows
            self._keep_alive.used(time.monotonic())
            # So does the idle collection's: a row admitted and ended within one turn left
            # the clock running, and back-to-back one-turn requests paid a full collection
            # every IDLE_COLLECT_SECONDS (a quarter of the engine thread, profiled).
            self._idle_since = None
        stepping = turn.step_seconds
        vision = self.composition.built.lanes.batch.vision
        if not self._tower_frozen and vision is not None and vision.built is not None:
            # The first image row built the tower (mlx-vlm imported, its weights read): what
            # that made lives as long as the model, so it is frozen as the load's was.
            self._tower_frozen = True
            freeze_live()
        stepping += self.run_embeddings(stepping)  # between steps, never beside one
        self.publish_stats(time.perf_counter() - self._started - stepping, fresh_memory=False)
        if self._probe is not None:
            lanes = self.composition.built.lanes
            self._probe.turn_ended(TurnReport(turn.admitted, turn.kv_bytes_projected,
                                              turn.prefix_bytes, self._book.snapshot(),
                                              lanes.rows_held(), lanes.batch_kv_bytes()))

    def run_embeddings(self, step_seconds: float = 0.0) -> float:
        """At most one due embedding batch; the seconds it took. ``step_seconds``: this
        turn's decode steps, which earn the encoder its share of the thread."""
        if not self._embeddings.pending:
            return 0.0
        seconds = self._embeddings.run_due(step_seconds)
        self._book.set(**embedding_figures(self._embeddings), **self.weights())
        return seconds

    def weights(self) -> dict[str, int]:
        """Weights and the resident bound: the chat model's plus the loaded embedding
        models' (an encoder's weights are held as the chat model's are)."""
        return weight_figures(self._embeddings, self._chat_weights, self._chat_bound)

    def idle_wait(self) -> float | None:
        """Seconds an idle loop may sleep: until the nearest deadline must fire."""
        deadlines = self.composition.core.deadlines()
        link = self.composition.link
        if link is not None:
            # Sharded: wake to check on the followers, so a dead one is found while idle.
            deadlines.append(time.monotonic() + heartbeat_seconds(self._config)
                             - link.silent_for())
        due = self._embeddings.due_at()  # an embedding batch waiting for its window
        if due is not None:
            deadlines.append(due)
        unload = self._keep_alive.unload_at()  # idle for keep_alive: time to unload
        if unload is not None:
            deadlines.append(unload)
        if self._idle_since is not None:  # rows ended: collect once quiet for a moment
            deadlines.append(self._idle_since + IDLE_COLLECT_SECONDS)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def collect_when_idle(self) -> None:
        # mlx-lm's finished batches (and failed rows' tracebacks) sit in reference cycles that
        # pin their KV arrays until Python's cyclic GC happens to run: ~6-16 MB of device
        # memory no counter showed after a 600-request storm on the tiny model. Collecting
        # once the engine has had nothing to run for IDLE_COLLECT_SECONDS returns it. Not at
        # once: a full collection took 67 ms with mlx-vlm loaded, and an agent's next turn,
        # sent as the last one ended, waited for it.
        scheduler, core = self.composition.scheduler, self.composition.core
        if not (core.ended_since_collect and scheduler.running == 0
                and scheduler.pending == 0):
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since >= IDLE_COLLECT_SECONDS:
            core.ended_since_collect = False
            self._idle_since = None
            collect_cycles()  # and freezes the rest: collections while busy skip it
            # The batch's freed KV otherwise stays in MLX's cache and malloc's arenas: the
            # process kept its peak (950 MB resident beside 514 MB of arrays, measured).
            self.composition.built.lanes.release_memory()
            self.publish_stats()  # the memory figures after the collection

    def publish_stats(self, overhead: float = 0.0, fresh_memory: bool = True) -> None:
        """The stats book's figures now; a busy turn (``fresh_memory=False``) reuses a
        resident-set reading up to a quarter second old."""
        scheduler, lanes = self.composition.scheduler, self.composition.built.lanes
        store = lanes.store
        active, cached = lanes.device_memory()
        self._book.add(overhead_seconds=overhead)
        self._book.set(
            running=scheduler.running, pending=scheduler.pending,
            kv_bytes_projected=scheduler.kv_bytes_projected,
            kv_bytes_held=lanes.batch_kv_bytes(),
            live_matchers=self.composition.built.preparer.compiler.live_matchers,
            prefix_hits=store.stats.hits, prefix_misses=store.stats.misses,
            prefix_hit_tokens=store.stats.hit_tokens,
            prefix_evictions=store.stats.evictions + store.stats.expirations,
            prefix_bytes=store.nbytes, prefix_entries=len(store),
            mlx_active_bytes=active, mlx_cache_bytes=cached,
            resident_bytes=self._resident.read(fresh_memory),
            **lanes.disk_figures(), **lanes.vision_figures(), **lanes.adapter_figures())
        version = lanes.speedups_version()
        if version != self._speedups_version:  # the span decision's figures moved
            self._speedups_version = version
            self._book.set(speedups=lanes.speedups(
                serial=scheduler.mode is BatchMode.SERIAL))


def embedding_figures(embeddings: EmbeddingService) -> dict[str, Any]:
    """The embedding counters as ``EngineStats`` fields."""
    counters = embeddings.counters
    return {"embed_requests": counters.requests, "embed_texts": counters.texts,
            "embed_tokens": counters.tokens, "embed_batches": counters.batches,
            "embed_peak_batch_texts": counters.peak_batch_texts,
            "embed_cancelled": counters.cancelled, "embed_failed": counters.failed,
            "embed_seconds": counters.seconds, "embed_pending": embeddings.pending}


def weight_figures(embeddings: EmbeddingService, chat_weights: int,
                   chat_bound: int) -> dict[str, int]:
    """Weights and the resident bound: the chat model's (0 before it loads) plus the
    loaded embedding models'."""
    extra = embeddings.weights_bytes
    return {"weights_bytes": chat_weights + extra,
            "resident_bound_bytes": (chat_bound + extra) if chat_bound else 0}
