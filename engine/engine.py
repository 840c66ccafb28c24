"""Engine: one thread that owns all MLX work, fed by a command queue.

Callers on any thread or event loop only enqueue ``_Submit`` / ``_Cancel`` /
``_Shutdown``. The engine thread runs one loop, one step at a time:

    plan    = scheduler.plan()          # cancellations first, then admissions
    step    = lane.step()               # the only device work (batch lane, serial lane)
    outcome = update(rows, step, now)   # every way a row ends is decided there
    publish                             # events to streams; the engine never waits on one
    embed                               # at most one due embedding batch, between steps

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.config import EngineConfig, checked_engine_args
from engine.core.lane import Lane, LaneRow
from engine.core.memory import resident_bytes
from engine.core.rows import Row
from engine.core.scheduler import BatchMode, LaneKind, Scheduler, StepPlan, Ticket
from engine.core.stats import EngineStats
from engine.core.step_probe import StepProbe, TurnReport
from engine.core.streams import RequestHandle, RequestStream
from engine.core.update import Ending, update
from engine.distributed.protocol import check_replicable, heartbeat_seconds
from engine.embedding.request import EmbeddingHandle, EmbeddingRequest, Embeddings, check_texts
from engine.embedding.service import EmbeddingService
from engine.errors import EngineClosedError, EngineDeadError, EngineError, RequestTimeoutError
from engine.models import config_context_limit, model_path_for
from engine.requests.chat import ChatRequest
from engine.requests.prepare import Preparer, request_spec
from engine.requests.request import (
    FinishReason,
    Prompt,
    RequestStatus,
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
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._chat_wanted = False  # set by start()/submit(); until then only embeddings run
        self._chat_weights = 0  # the chat model's weights and resident bound, once loaded
        self._chat_bound = 0
        self._held: list[_Command] = []  # commands a chatless loop left for the chat loop
        self._embedding_paths: dict[ModelSpec, Path] = {}
        self._embeddings = EmbeddingService(self.config.embed_window,
                                            self.config.embed_max_batch,
                                            self.config.embed_share)
        # Engine-thread state below: touched only by the engine thread once it runs
        # (the model and preparer are read-only for callers after loading).
        self._model: LoadedModel | None = None
        self._preparer: Preparer | None = None
        self._lanes: Lanes | None = None
        self._link: Link | None = None  # rank 0 of a sharded engine: the followers' end
        self._scheduler: Scheduler | None = None
        self._rows: dict[int, Row] = {}
        self._consecutive_failures = 0
        self._ended_since_collect = False
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
        with self._stats_lock:
            return replace(self._stats)

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
        group = _shard_group(self.config)
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
        self._model = model
        self._chat_weights, self._chat_bound = bounds.weights_bytes, bounds.resident_bound
        with self._stats_lock:
            self._stats.kv_budget_bytes = bounds.kv_budget_bytes
            self._stats.prefix_cache_limit_bytes = store.max_bytes
            self._stats.buffer_cache_limit_bytes = bounds.buffer_cache_bytes
            self._count_weights()
            self._stats.loaded = True
            self._stats.batch_mode = self._scheduler.mode.value
            self._stats.context_limit = model.footprint.context_limit
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
        with self._stats_lock:
            stats = self._stats
            stats.embed_requests, stats.embed_texts = counters.requests, counters.texts
            stats.embed_tokens, stats.embed_batches = counters.tokens, counters.batches
            stats.embed_peak_batch_texts = counters.peak_batch_texts
            stats.embed_cancelled, stats.embed_failed = counters.cancelled, counters.failed
            stats.embed_seconds, stats.embed_pending = counters.seconds, self._embeddings.pending
            self._count_weights()
        return seconds

    def _count_weights(self) -> None:
        """Weights and the resident bound: the chat model's plus the loaded embedding
        models' (an encoder's weights are held as the chat model's are). Under the stats
        lock, on the engine thread."""
        extra = self._embeddings.weights_bytes
        self._stats.weights_bytes = self._chat_weights + extra
        self._stats.resident_bound_bytes = (self._chat_bound + extra) if self._chat_bound else 0

    def _serve_once(self) -> bool:
        """One turn of the loop: commands, plan, step each lane, publish."""
        scheduler, lanes = self._scheduler, self._lanes
        assert scheduler is not None and lanes is not None
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
                self._accept(command.row)
            elif command.request_id in self._rows:
                scheduler.cancel(command.request_id)
        self._expire_deadlines()
        plan = scheduler.plan()
        self._apply(plan)
        scheduler.fit_cache()  # rows evicted by the plan may have stored their KV
        probe = self._probe
        if probe is not None:  # the turn's peak: right after admission, before any step
            admitted = tuple(t.request_id for kind in LaneKind for t in plan.admitted(kind))
            peak = (scheduler.kv_bytes_projected, lanes.store.nbytes)
        stepping = 0.0
        for kind in LaneKind:
            lane = self._lane(kind)
            if len(lane):
                stepping += self._step(kind, lane)
        scheduler.fit_cache()  # heads and finished rows may have been stored
        stepping += self._run_embeddings(stepping)  # between steps, never beside one
        self._publish_stats(time.perf_counter() - started - stepping)
        if probe is not None:
            probe.turn_ended(TurnReport(admitted, *peak, self.stats()))
        return True

    def _lane(self, kind: LaneKind) -> Lane:
        assert self._lanes is not None
        return self._lanes.lane(kind.value)

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
        deadlines = [r.deadline for r in self._rows.values() if r.deadline is not None]
        if self._link is not None:
            # Sharded: wake to check on the followers, so a dead one is found while idle.
            link = self._link
            deadlines.append(time.monotonic() + heartbeat_seconds(self.config)
                             - link.silent_for())
        due = self._embeddings.due_at()  # an embedding batch waiting for its window
        if due is not None:
            deadlines.append(due)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self, row: Row) -> None:
        """Prepare a submitted request once; a request that cannot run fails alone."""
        scheduler, preparer = self._scheduler, self._preparer
        assert scheduler is not None and preparer is not None
        self._rows[row.request_id] = row
        try:
            prepared = preparer.prepare(row.spec)
            kv_bytes = scheduler.validate(len(prepared.prompt_ids), prepared.params.max_tokens)
        except Exception as exc:
            self._end(Ending(row, FinishReason.ERROR, exc))
            return
        row.prepared = prepared
        row.text = preparer.row_text(prepared.params)
        row.channels = preparer.row_channels(row.spec, prepared)
        lane = scheduler.lane_for(prepared.params.needs_serial_lane)
        scheduler.enqueue(Ticket(row.request_id, len(prepared.prompt_ids),
                                 prepared.params.max_tokens, kv_bytes, lane))

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for row in self._rows.values():
            if row.deadline is not None and row.deadline <= now and row.cancel_error is None:
                row.cancel_error = RequestTimeoutError(
                    f"request {row.request_id} timed out after "
                    f"{row.deadline - row.submitted_at:.3g} s"
                )
                assert self._scheduler is not None
                self._scheduler.cancel(row.request_id)

    def _apply(self, plan: StepPlan) -> None:
        """Carry out the plan: drop and evict cancelled rows, start admitted ones."""
        if not plan:
            return
        cancelled = [self._rows[i] for i in (*plan.dropped, *plan.evict)]
        for kind in LaneKind:
            evicted = [r.request_id for r in cancelled if r.holds_lane and r.lane is kind]
            if evicted:
                self._lane(kind).remove(evicted)
        for row in cancelled:
            self._end(Ending(row, FinishReason.CANCELLED, row.cancel_error))
        admitted = 0
        for kind in LaneKind:
            rows = [self._rows[t.request_id] for t in plan.admitted(kind)]
            for row in rows:
                row.status, row.lane = RequestStatus.PREFILLING, kind
            if rows:
                self._lane(kind).insert([_lane_row(row) for row in rows])
                admitted += sum(len(row.prepared.prompt_ids) for row in rows
                                if row.prepared is not None)
        with self._stats_lock:
            self._stats.prompt_tokens += admitted

    def _step(self, kind: LaneKind, lane: Lane) -> float:
        """Step one lane, decide what its tokens mean, publish; returns the step's seconds."""
        started = time.perf_counter()
        try:
            if self._probe is not None:
                self._probe.before_step(kind.value)
            step = lane.step()
        except EngineDeadError:  # a sharded engine's rank failed: nothing to contain
            raise
        except Exception as exc:  # contained below, or fatal after retries
            self._model_failure(lane, exc)
            return time.perf_counter() - started
        seconds = time.perf_counter() - started
        self._consecutive_failures = 0
        outcome = update(self._rows, step, time.monotonic())
        with self._stats_lock:
            self._stats.steps += 1
            self._stats.step_seconds += seconds
            self._stats.peak_running = max(self._stats.peak_running, step.width)
            self._stats.generated_tokens += outcome.tokens
            self._stats.forced_tokens += outcome.forced
            self._stats.drafted_tokens += outcome.drafted
        for row, event in outcome.events:
            row.stream.publish(event)
        if outcome.endings:
            ended = [ending.row.request_id for ending in outcome.endings]
            lane.remove(ended)
            assert self._scheduler is not None
            self._scheduler.finish(ended)
            for ending in outcome.endings:
                self._end(ending)
        return seconds

    def _collect_when_idle(self) -> None:
        # mlx-lm's finished batches (and failed rows' tracebacks) sit in reference cycles that
        # pin their KV arrays until Python's cyclic GC happens to run: ~6-16 MB of device
        # memory no counter showed after a 600-request storm on the tiny model. Collecting
        # once the engine has nothing to run returns it at no cost to any row's latency.
        scheduler = self._scheduler
        if (self._ended_since_collect and scheduler is not None
                and scheduler.running == 0 and scheduler.pending == 0):
            self._ended_since_collect = False
            gc.collect()
            # The batch's freed KV otherwise stays in MLX's cache and malloc's arenas: the
            # process kept its peak (950 MB resident beside 514 MB of arrays, measured).
            assert self._lanes is not None
            self._lanes.release_memory()
            self._publish_stats()  # the memory figures after the collection

    def _end(self, ending: Ending) -> None:
        """A row's last event: the row leaves the engine, its consumer wakes last."""
        row = ending.row
        self._ended_since_collect = True
        self._rows.pop(row.request_id, None)
        was = row.status
        event, completion = row.final(ending.reason, ending.error, ending.delta,
                                      ending.token_ids, ending.logprobs)
        with self._stats_lock:
            if ending.reason is FinishReason.ERROR:
                self._stats.failed += 1
            elif ending.reason is FinishReason.CANCELLED:
                self._stats.cancelled += 1
            else:
                self._stats.completed += 1
            # Before the consumer wakes, so whoever holds a result sees its row gone; one
            # row at a time, so the counts agree with completed/cancelled at every moment.
            if was in (RequestStatus.PREFILLING, RequestStatus.DECODING):
                self._stats.running = max(0, self._stats.running - 1)
            elif was is RequestStatus.WAITING and row.prepared is not None:
                self._stats.pending = max(0, self._stats.pending - 1)
        row.stream.publish(event, completion)

    def _model_failure(self, lane: Lane, exc: Exception) -> None:
        """A model step failed: fail the lane's rows, then recover or die."""
        log.error("model step failed: %r", exc)
        self._consecutive_failures += 1
        failed = lane.reset()
        assert self._scheduler is not None
        self._scheduler.finish(failed)
        for request_id in failed:
            row = self._rows.get(request_id)
            if row is not None:
                error = EngineError(f"the model step failed: {exc!r}")
                error.__cause__ = exc
                self._end(Ending(row, FinishReason.ERROR, error))
        if self._consecutive_failures >= self.config.max_consecutive_step_failures:
            raise EngineDeadError(
                f"{self._consecutive_failures} model steps failed in a row; last: {exc!r}"
            ) from exc

    def _publish_stats(self, overhead: float = 0.0) -> None:
        scheduler, lanes = self._scheduler, self._lanes
        assert scheduler is not None and lanes is not None
        store = lanes.store
        active, cached = lanes.device_memory()
        with self._stats_lock:
            self._stats.overhead_seconds += overhead
            self._stats.running = scheduler.running
            self._stats.pending = scheduler.pending
            self._stats.kv_bytes_projected = scheduler.kv_bytes_projected
            assert self._preparer is not None
            self._stats.live_matchers = self._preparer.compiler.live_matchers
            self._stats.prefix_hits = store.stats.hits
            self._stats.prefix_misses = store.stats.misses
            self._stats.prefix_hit_tokens = store.stats.hit_tokens
            self._stats.prefix_evictions = store.stats.evictions + store.stats.expirations
            self._stats.prefix_bytes = store.nbytes
            self._stats.prefix_entries = len(store)
            self._stats.mlx_active_bytes = active
            self._stats.mlx_cache_bytes = cached
            self._stats.resident_bytes = resident_bytes()

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
        with self._stats_lock:
            self._stats.running = self._stats.pending = 0
            self._stats.embed_failed += failed
            self._stats.embed_pending = 0

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
        if self._scheduler is not None:
            self._scheduler.drain()
        for row in list(self._rows.values()):
            self._end(Ending(row, reason, error))
        held, self._held = self._held, []  # left by the embeddings-only loop
        while True:
            try:
                command = held.pop(0) if held else self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                self._end(Ending(command.row, reason, error))
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


def _lane_row(row: Row) -> LaneRow:
    assert row.prepared is not None
    prepared = row.prepared
    return LaneRow(row.request_id, prepared.prompt_ids, prepared.params, prepared.head_len)


def _shard_group(config: EngineConfig) -> Any:
    """The distributed group a sharded engine runs on (rank 0 only); None when not sharded."""
    if config.shard is None:
        return None
    from engine.device.collectives import init_group

    group = init_group()
    if group.size() == 1:
        log.warning("shard=%r but this process is not part of a distributed group "
                    "(MLX_HOSTFILE and MLX_RANK): running unsharded", config.shard)
        return None
    if group.rank() != 0:
        raise EngineError(f"rank {group.rank()} of a sharded engine follows rank 0: call "
                          f"engine.follow(model, config) there instead of using an Engine")
    return group



@atexit.register
def _close_all_engines() -> None:
    for engine in list(_live_engines):
        engine.close(timeout=5.0)
