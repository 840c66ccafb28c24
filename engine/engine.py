"""Engine: the public facade; one thread that owns all MLX work, fed by a command queue.

Callers on any thread or event loop only enqueue ``_Submit`` / ``_Cancel`` /
``_Shutdown``. The engine thread loads the model, then runs one loop, one turn at a time:

    commands                            # accepted rows and cancellations, to the step core
    turn = core.turn()                  # plan -> step -> update -> publish (core/step_core.py)
    embed                               # at most one due embedding batch, between steps
    stats                               # the turn's figures, written in one place (StatsBook)

One engine hosts the chat model and any embedding models, on the same thread: embeddings
never run MLX beside a decode step. The chat model loads only once chat is asked for
(``start``, ``submit``): an engine used only through ``embed`` never loads it.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.config import EngineConfig, checked_engine_args
from engine.core.memory import resident_bytes
from engine.core.rows import Row
from engine.core.scheduler import BatchMode, Scheduler
from engine.core.stats import EngineStats, StatsBook
from engine.core.step_core import StepCore, end_row
from engine.core.step_probe import StepProbe, TurnReport
from engine.core.streams import RequestHandle, RequestStream
from engine.core.update import Ending
from engine.distributed.group import shard_group
from engine.distributed.protocol import check_replicable, heartbeat_seconds
from engine.embedding.request import EmbeddingHandle, EmbeddingRequest, Embeddings, check_texts
from engine.embedding.service import EmbeddingService
from engine.errors import EngineClosedError, EngineDeadError
from engine.models import config_context_limit, model_path_for
from engine.requests.chat import ChatRequest
from engine.requests.prepare import Preparer, request_spec
from engine.requests.request import (
    FinishReason,
    Prompt,
    SamplingParams,
    TokenCallback,
    Tools,
    check_callbacks,
)

if TYPE_CHECKING:
    from engine.device.loader import Lanes, LoadedModel
    from engine.distributed.link import Link

log = logging.getLogger("engine")
ModelSpec = str | os.PathLike[str] | None


@dataclass(frozen=True)
class _Submit:
    row: Row


@dataclass(frozen=True)
class _Cancel:
    request_id: int


@dataclass(frozen=True)
class _Shutdown:
    pass


@dataclass(frozen=True)
class _Embed:
    request: EmbeddingRequest


@dataclass(frozen=True)
class _WantChat:
    """Wakes a thread serving only embeddings: the chat model is wanted now."""


_Command = _Submit | _Cancel | _Shutdown | _Embed | _WantChat
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class Engine:
    """A continuous-batching engine for one model, shared by every caller in a process.

    Construction is cheap: the model is resolved and loaded on the engine thread at
    ``start()`` or the first ``submit``. Use as a context manager or call ``close()``;
    engines still open at interpreter exit are closed then.
    """

    def __init__(self, model: ModelSpec = None, config: EngineConfig | None = None, *,
                 probe: StepProbe | None = None) -> None:
        """``probe``: a test seam (``engine.StepProbe``) that injects step faults and sees
        every turn of the loop; None (the default) costs nothing."""
        self.model_spec = model
        self.config = checked_engine_args(model, config)
        if probe is not None and not isinstance(probe, StepProbe):
            raise TypeError(f"probe must be an engine.StepProbe or None, got "
                            f"{type(probe).__name__}")
        self._probe = probe
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._closed = False
        self._dead: BaseException | None = None
        self._abandoned = False  # a sharded step never returned (see _abandon)
        self._model_path: Path | None = None
        self._book = StatsBook()  # the one writer of stats(), safe from any thread
        self._chat_wanted = False  # set by start()/submit(); until then only embeddings run
        self._chat_weights = 0  # the chat model's weights and resident bound, once loaded
        self._chat_bound = 0
        self._held: list[_Command] = []  # commands a chatless loop left for the chat loop
        self._embedding_paths: dict[ModelSpec, Path] = {}
        self._embeddings = EmbeddingService(
            self.config.embed_window, self.config.embed_max_batch, self.config.embed_share,
            before_encode=None if probe is None else probe.before_embed)
        # Engine-thread state below: touched only by the engine thread once it runs
        # (the model and preparer are read-only for callers after loading).
        self._model: LoadedModel | None = None
        self._preparer: Preparer | None = None
        self._lanes: Lanes | None = None
        self._link: Link | None = None  # rank 0 of a sharded engine: the followers' end
        self._scheduler: Scheduler | None = None
        self._core: StepCore | None = None  # plan -> step -> update -> publish, once loaded
        self._touched_mlx = False
        _live_engines.add(self)

    # ----- public API ---------------------------------------------------------------

    @property
    def model_path(self) -> Path:
        """The resolved local model directory (what ``mlx_lm.load`` would load)."""
        # Its own lock: resolving may download and convert, and submit must not wait on it.
        with self._resolve_lock:
            if self._model_path is None:
                self._model_path = model_path_for(self.model_spec, self.config.quantized)
            return self._model_path

    @property
    def tokenizer(self) -> Any:
        """The model's mlx-lm ``TokenizerWrapper`` (loads the model if needed)."""
        return self._loaded_model().tokenizer

    def start(self, timeout: float | None = None) -> Engine:
        """Start the engine thread and wait until the model is loaded (or failed)."""
        with self._lock:
            if not self._chat_wanted:
                self._chat_wanted = True
                if self._thread is not None:  # a thread serving only embeddings: wake it
                    self._commands.put(_WantChat())
        self._ensure_thread()
        if not self._loaded.wait(timeout):
            raise TimeoutError("the model did not load within the timeout")
        self._raise_if_unusable()
        return self

    def submit(
        self,
        prompt: Prompt | ChatRequest,
        params: SamplingParams | None = None,
        *,
        on_token: TokenCallback | None = None,
        timeout: float | None = None,
        tools: Tools | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RequestHandle:
        """Queue a request and return its handle at once (never blocks on the model).

        ``prompt`` is text, token ids, chat messages (rendered with the chat template), or
        a ``ChatRequest`` (taken as it is; it carries its own params, tools and options).
        Chat messages, tools and tool choice are read by ``ChatRequest.from_openai``.
        ``on_token(token_id, text_delta)`` runs on the engine thread; returning False
        stops the row, raising fails it. ``timeout`` (seconds) cancels it when passed.
        ``tools`` (OpenAI function format) need a chat-messages prompt; ``tool_choice``
        is "auto", "none", "required"/"any" or a tool name, and the last two are enforced
        by a grammar. Invalid tools, tool choices or constraints raise here, at once.
        """
        check_callbacks(on_token, timeout)
        spec = request_spec(prompt, params, tools, tool_choice, parallel_tool_calls,
                             chat_template_kwargs)
        if self.config.shard is not None:
            check_replicable(spec.params)  # never reaches the other ranks
        now = time.monotonic()
        stream = RequestStream()
        with self._lock:
            self._raise_if_unusable()
            request_id = next(self._ids)
            row = Row(request_id, spec, stream, on_token, now,
                      None if timeout is None else now + timeout)
            self._chat_wanted = True
            self._commands.put(_Submit(row))
        self._ensure_thread()
        return RequestHandle(request_id, stream, lambda: self._commands.put(_Cancel(request_id)))

    def embed(self, texts: Sequence[str], model: ModelSpec = None, *,
              timeout: float | None = None) -> EmbeddingHandle:
        """Queue texts for embedding and return a handle at once (vectors: ``.result()``).

        ``model`` is an embedding model: None (all-MiniLM-L6-v2, downloaded once), a local
        sentence-transformers directory or a hub id. Texts past its ``max_seq_length`` (256
        tokens for the default) are truncated. Requests from any thread or event loop are
        batched (``embed_window``, ``embed_max_batch``) and run on the engine thread between
        decode steps. Bad texts raise ``TypeError``/``ValueError`` here; the first call for
        a model may download it on this thread (``embedding_model_path`` does it ahead).
        """
        checked = check_texts(texts)
        check_callbacks(None, timeout)
        path = self.embedding_model_path(model)
        from engine.models.embedding_model import embedding_model_name

        now = time.monotonic()
        with self._lock:
            self._raise_if_unusable()
            request = EmbeddingRequest(next(self._ids), checked, path,
                                       embedding_model_name(model), now,
                                       None if timeout is None else now + timeout)
            if checked:
                self._embeddings.register(request)  # what _abandon fails from the watchdog
                self._commands.put(_Embed(request))
        if checked:
            self._ensure_thread()
        else:  # nothing to run: no vectors, and no model loaded for it
            request.finish(Embeddings(np.zeros((0, 0), np.float32), 0, request.model_name))
        return EmbeddingHandle(request)

    def embedding_model_path(self, model: ModelSpec = None) -> Path:
        """The local directory of an embedding model, downloading the default once."""
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(f"model must be None, a path or a hub id, got "
                            f"{type(model).__name__}")
        with self._resolve_lock:
            path = self._embedding_paths.get(model)
            if path is None:
                from engine.models.embedding_model import resolve_embedding_model

                path = self._embedding_paths[model] = resolve_embedding_model(model)
            return path

    def count_tokens(
        self,
        prompt: Prompt,
        *,
        tools: Tools | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> int:
        """Prompt tokens ``submit`` would use for this prompt (loads the model if needed)."""
        spec = request_spec(prompt, None, tools, None, True, chat_template_kwargs)
        self._loaded_model()
        assert self._preparer is not None
        return self._preparer.count_tokens(spec)

    @property
    def context_limit(self) -> int | None:
        """The model's context limit in tokens, without loading the weights."""
        limit = self.stats().context_limit
        return limit if limit is not None else config_context_limit(self.model_path)

    def stats(self) -> EngineStats:
        """A consistent snapshot of the engine's counters (safe from any thread)."""
        return self._book.snapshot()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel everything in flight, stop the thread, release the model."""
        with self._lock:
            if self._closed:
                thread = self._thread
            else:
                self._closed = True
                self._commands.put(_Shutdown())
                thread = self._thread
            if self._abandoned:
                thread = None  # stuck in a collective a rank never joins: it cannot end
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def serves_chat(self) -> bool:
        """Whether chat has been asked of this engine (its chat model loads, or has loaded)."""
        return self._chat_wanted

    @property
    def usable(self) -> bool:
        """False once the engine is closed or dead (every call would then raise)."""
        return self._dead is None and not self._closed

    # ----- caller-side helpers ------------------------------------------------------

    def _raise_if_unusable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._raise_if_unusable()
                self._thread = threading.Thread(
                    target=self._main, name=f"mlx-engine-{id(self):x}", daemon=True
                )
                self._thread.start()

    def _loaded_model(self) -> LoadedModel:
        """The loaded model (loads it if needed); raises once the engine is closed."""
        self.start()
        if self._model is None or self._closed:
            raise EngineClosedError("the engine is closed")
        return self._model

    # ----- the engine thread ----------------------------------------------------------

    def _main(self) -> None:
        try:
            if not self._chat_wanted and not self._serve_embeddings_only():
                return  # closed before anyone asked for the chat model
            try:
                self._load()
            except Exception as exc:  # the caller's to fix: its cause names the model
                self._die(_load_error(exc, self.model_spec))
                return
            self._loaded.set()
            while self._serve_once():
                self._collect_when_idle()
        except BaseException as exc:  # every waiter must learn of it
            self._die(exc)
        finally:
            self._loaded.set()
            if self._touched_mlx:
                from engine.device.loader import release_streams

                release_streams()

    def _load(self) -> None:
        self._touched_mlx = True  # importing mlx gives this thread a stream to release
        from engine.device.loader import build_lanes, load_model

        path = self.model_path
        group = shard_group(self.config)
        model = load_model(path, self.config, group, config_context_limit(path))
        self._preparer = Preparer(model.tokenizer, path, model.vocab_size,
                                  self.config.json_string_ngram)
        self._lanes = build_lanes(model, self.config, self._preparer.compiler)
        if self._lanes.channel is not None:  # rank 0 of a sharded engine
            from engine.distributed.replicated_lane import replicate

            self._link = replicate(self._lanes, self.config.distributed_timeout,
                                   on_hang=self._abandon)
        store = self._lanes.store
        # Cached prefixes count against the KV budget and are the first thing to give way.
        bounds = model.bounds  # the settings' "auto" values resolved for this machine
        self._scheduler = Scheduler(model.footprint, self.config.max_batch,
                                    bounds.kv_budget_bytes or None,
                                    cache_bytes=lambda: store.nbytes, reclaim=store.shrink_to)
        lanes = self._lanes
        self._core = StepCore(self._scheduler, lanes.lane, self._preparer, self._book,
                              prefix_bytes=lambda: store.nbytes,
                              max_consecutive_failures=self.config.max_consecutive_step_failures,
                              probe=self._probe)
        self._model = model
        self._chat_weights, self._chat_bound = bounds.weights_bytes, bounds.resident_bound
        self._book.set(kv_budget_bytes=bounds.kv_budget_bytes,
                       prefix_cache_limit_bytes=store.max_bytes,
                       buffer_cache_limit_bytes=bounds.buffer_cache_bytes,
                       loaded=True, batch_mode=self._scheduler.mode.value,
                       context_limit=model.footprint.context_limit, **self._weights(),
                       **model.weights.stats())
        if self._scheduler.mode is BatchMode.SERIAL:
            log.warning("model caches (%s) cannot batch: requests run one at a time",
                        ", ".join(model.footprint.non_batchable_kinds))

    def _serve_embeddings_only(self) -> bool:
        """Serve embeddings until chat is wanted (True) or the engine closes (False)."""
        while True:
            due = self._embeddings.due_at()
            commands = self._take_commands(
                block=True, wait=None if due is None else max(0.0, due - time.monotonic()))
            for command in commands:
                if isinstance(command, _Shutdown):
                    self._fail_everything(
                        EngineClosedError("the engine was closed while the request ran"),
                        FinishReason.CANCELLED)
                    return False
                if isinstance(command, _Embed):
                    self._embeddings.add(command.request)
                else:  # a chat request: the chat loop takes it and the rest in order
                    self._held.append(command)
            self._run_embeddings()
            if self._held:
                return True

    def _run_embeddings(self, step_seconds: float = 0.0) -> float:
        """At most one due embedding batch; the seconds it took. ``step_seconds``: this
        turn's decode steps, which earn the encoder its share of the thread."""
        if not self._embeddings.pending:
            return 0.0
        self._touched_mlx = True  # an encoder may be loaded and run on this thread
        seconds = self._embeddings.run_due(step_seconds)
        counters = self._embeddings.counters
        self._book.set(
            embed_requests=counters.requests, embed_texts=counters.texts,
            embed_tokens=counters.tokens, embed_batches=counters.batches,
            embed_peak_batch_texts=counters.peak_batch_texts,
            embed_cancelled=counters.cancelled, embed_failed=counters.failed,
            embed_seconds=counters.seconds, embed_pending=self._embeddings.pending,
            **self._weights())
        return seconds

    def _weights(self) -> dict[str, int]:
        """Weights and the resident bound: the chat model's plus the loaded embedding
        models' (an encoder's weights are held as the chat model's are)."""
        extra = self._embeddings.weights_bytes
        return {"weights_bytes": self._chat_weights + extra,
                "resident_bound_bytes": (self._chat_bound + extra) if self._chat_bound else 0}

    def _serve_once(self) -> bool:
        """One turn of the loop: commands, the core's turn, embeddings, stats."""
        scheduler, core = self._scheduler, self._core
        assert scheduler is not None and core is not None
        idle = scheduler.is_idle()
        commands = self._take_commands(block=idle)
        link = self._link
        if idle and link is not None and link.silent_for() >= heartbeat_seconds(self.config):
            link.heartbeat()  # raises EngineDeadError if a follower is gone
        started = time.perf_counter()
        for command in commands:
            if isinstance(command, _Shutdown):
                self._shutdown()
                return False
            if isinstance(command, _Embed):
                self._embeddings.add(command.request)
            elif isinstance(command, _WantChat):
                continue
            elif isinstance(command, _Submit):
                core.accept(command.row)
            else:
                core.cancel(command.request_id)
        turn = core.turn()
        stepping = turn.step_seconds
        stepping += self._run_embeddings(stepping)  # between steps, never beside one
        self._publish_stats(time.perf_counter() - started - stepping)
        if self._probe is not None:
            lanes = self._lanes
            assert lanes is not None
            self._probe.turn_ended(TurnReport(turn.admitted, turn.kv_bytes_projected,
                                              turn.prefix_bytes, self.stats(),
                                              lanes.rows_held(), lanes.batch_kv_bytes()))
        return True

    def _take_commands(self, block: bool, wait: float | None = None) -> list[_Command]:
        commands, self._held = self._held, []  # left by the embeddings-only loop
        if block and not commands:
            try:
                commands.append(self._commands.get(
                    timeout=wait if self._scheduler is None else self._idle_wait()))
            except queue.Empty:
                return commands
            if isinstance(commands[0], _Submit) and self.config.admission_window > 0:
                self._gather_burst(commands)
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _gather_burst(self, commands: list[_Command]) -> None:
        """On an idle engine, wait up to ``admission_window`` for more submits to join the
        first, so a burst starts as one prefill group instead of its first row alone."""
        deadline = time.monotonic() + self.config.admission_window
        submits = 1
        while submits < self.config.prefill_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                command = self._commands.get(timeout=left)
            except queue.Empty:
                return
            commands.append(command)
            if isinstance(command, _Shutdown):
                return
            submits += isinstance(command, _Submit)

    def _idle_wait(self) -> float | None:
        # Sleep until the next command, or until the nearest deadline must fire.
        deadlines = self._core.deadlines() if self._core is not None else []
        if self._link is not None:
            # Sharded: wake to check on the followers, so a dead one is found while idle.
            link = self._link
            deadlines.append(time.monotonic() + heartbeat_seconds(self.config)
                             - link.silent_for())
        due = self._embeddings.due_at()  # an embedding batch waiting for its window
        if due is not None:
            deadlines.append(due)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _collect_when_idle(self) -> None:
        # mlx-lm's finished batches (and failed rows' tracebacks) sit in reference cycles that
        # pin their KV arrays until Python's cyclic GC happens to run: ~6-16 MB of device
        # memory no counter showed after a 600-request storm on the tiny model. Collecting
        # once the engine has nothing to run returns it at no cost to any row's latency.
        scheduler, core = self._scheduler, self._core
        if (core is not None and core.ended_since_collect and scheduler is not None
                and scheduler.running == 0 and scheduler.pending == 0):
            core.ended_since_collect = False
            gc.collect()
            # The batch's freed KV otherwise stays in MLX's cache and malloc's arenas: the
            # process kept its peak (950 MB resident beside 514 MB of arrays, measured).
            assert self._lanes is not None
            self._lanes.release_memory()
            self._publish_stats()  # the memory figures after the collection

    def _publish_stats(self, overhead: float = 0.0) -> None:
        scheduler, lanes = self._scheduler, self._lanes
        assert scheduler is not None and lanes is not None
        store = lanes.store
        active, cached = lanes.device_memory()
        assert self._preparer is not None
        self._book.add(overhead_seconds=overhead)
        self._book.set(
            running=scheduler.running, pending=scheduler.pending,
            kv_bytes_projected=scheduler.kv_bytes_projected,
            live_matchers=self._preparer.compiler.live_matchers,
            prefix_hits=store.stats.hits, prefix_misses=store.stats.misses,
            prefix_hit_tokens=store.stats.hit_tokens,
            prefix_evictions=store.stats.evictions + store.stats.expirations,
            prefix_bytes=store.nbytes, prefix_entries=len(store),
            mlx_active_bytes=active, mlx_cache_bytes=cached, resident_bytes=resident_bytes())

    def _shutdown(self) -> None:
        error = EngineClosedError("the engine was closed while the request ran")
        self._reset_lanes()
        self._fail_everything(error, FinishReason.CANCELLED)
        if self._link is not None:
            self._link.shutdown()  # a sharded engine's followers stop too
        self._publish_stats()

    def _die(self, exc: BaseException) -> None:
        dead: BaseException = exc
        if isinstance(exc, _LoadFailure):  # the cause (by kind) is the load error itself
            dead = EngineDeadError(f"the model could not be loaded: {exc}")
            dead.__cause__ = exc.error
        elif not isinstance(exc, EngineDeadError):
            dead = EngineDeadError(f"the engine thread died: {exc!r}")
            dead.__cause__ = exc
        log.error("engine is dead: %r", dead)
        with self._lock:
            self._dead = dead
        try:
            self._reset_lanes()
        except Exception:  # best effort on the way out
            log.exception("releasing rows after the engine died failed")
        self._fail_everything(dead, FinishReason.ERROR)
        if self._link is not None:
            try:
                self._link.shutdown()  # followers stop, unless a rank is what failed
            except Exception:
                log.exception("stopping the followers failed")
        if self._scheduler is not None and self._lanes is not None:
            self._publish_stats()

    def _abandon(self, dead: EngineDeadError) -> None:
        """A sharded step never returned (a rank stopped answering): from the watchdog.

        The engine thread is stuck inside a collective and touches no row meanwhile (if
        the collective ever returns, the lane raises ``dead`` and the thread dies); every
        waiter learns now, and later submits raise at once. Rows are ended from here
        because the thread is parked: ``Link._hang`` calls this holding the lock the
        thread's ``Link.end`` must take first. Embedding requests are failed through the
        service's own lock instead, never through the batcher, so they are safe whatever
        the engine thread is doing.
        """
        with self._lock:
            if self._dead is not None:
                return
            self._dead = dead
            self._abandoned = True
        failed = self._embeddings.fail_registered(dead)
        self._fail_everything(dead, FinishReason.ERROR, engine_thread=False)
        self._book.set(running=0, pending=0, embed_pending=0)
        self._book.add(embed_failed=failed)

    def _reset_lanes(self) -> None:
        """Release every row (and its grammar matcher): the engine is going away."""
        if self._lanes is not None:
            self._lanes.batch.reset()
            self._lanes.serial.reset()

    def _fail_everything(self, error: BaseException, reason: FinishReason, *,
                         engine_thread: bool = True) -> None:
        """Fail every row and request; ``engine_thread=False`` (the watchdog) leaves the
        embedding batcher and counters alone: its caller failed those requests already."""
        # Rows known to the engine thread, then submits still sitting in the queue.
        if self._core is not None:
            self._core.fail_rows(error, reason)
        held, self._held = self._held, []  # left by the embeddings-only loop
        while True:
            try:
                command = held.pop(0) if held else self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                end_row(Ending(command.row, reason, error), self._book)
            elif (isinstance(command, _Embed) and command.request.finish(error=error)
                  and engine_thread):
                self._embeddings.counters.failed += 1
        if engine_thread:
            self._embeddings.fail_all(error)


class _LoadFailure(Exception):
    """Carries a model's load error to ``_die``: callers get ``EngineDeadError`` whose
    message names the model and the error, and whose ``__cause__`` is the error itself
    (``FileNotFoundError``, ``InvalidModelError``, ``ModelDownloadError``...)."""

    def __init__(self, error: Exception, name: str) -> None:
        super().__init__(f"{name}: {error!r}")
        self.error = error


def _load_error(exc: Exception, spec: ModelSpec) -> _LoadFailure:
    name = "the default model" if spec is None else repr(os.fspath(spec))
    return _LoadFailure(exc, name)


@atexit.register
def _close_all_engines() -> None:
    for engine in list(_live_engines):
        engine.close(timeout=5.0)
