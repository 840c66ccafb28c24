"""Engine: one thread that owns all MLX work, fed by a command queue.

Callers on any thread or event loop only enqueue ``_Submit`` / ``_Cancel`` /
``_Shutdown``. At every step boundary the engine thread drains the queue, applies
cancellations first, admits, runs one step of the batch (and of the serial lane),
and publishes each row's events without ever waiting on a consumer.
"""

from __future__ import annotations

import atexit
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
from typing import Any

from engine.channels import ChannelSplitter, RowChannels
from engine.config import EngineConfig
from engine.errors import EngineClosedError, EngineDeadError, EngineError, RequestTimeoutError
from engine.grammar import validate_constraint
from engine.models import config_context_limit
from engine.request import (
    FinishReason,
    Prompt,
    SamplingParams,
    TokenCallback,
    TokenLogprob,
)
from engine.rows import Row
from engine.scheduler import BatchMode, Scheduler, StepPlan, Ticket
from engine.stats import EngineStats
from engine.streams import RequestHandle, RequestStream
from engine.text import RowText
from engine.tools import (
    forced_call_grammar,
    normalize_tool_choice,
    normalize_tools,
)

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


_Command = _Submit | _Cancel | _Shutdown
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class Engine:
    """A continuous-batching engine for one model, shared by every caller in a process.

    Construction is cheap: the model is resolved and loaded on the engine thread at
    ``start()`` or the first ``submit``. Use as a context manager or call ``close()``;
    engines still open at interpreter exit are closed then.
    """

    def __init__(self, model: ModelSpec = None, config: EngineConfig | None = None) -> None:
        self.model_spec = model
        self.config = config or EngineConfig()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._model_path: Path | None = None
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        # Engine-thread state below: touched only by the engine thread once it runs.
        self._runner: Any = None
        self._scheduler: Scheduler | None = None
        self._rows: dict[int, Row] = {}
        self._consecutive_failures = 0
        _live_engines.add(self)

    # ----- public API ---------------------------------------------------------------

    @property
    def model_path(self) -> Path:
        """The resolved local model directory (what ``mlx_lm.load`` would load)."""
        # Its own lock: resolving may download and convert, and submit must not wait on it.
        with self._resolve_lock:
            if self._model_path is None:
                self._model_path = _resolve(self.model_spec, self.config)
            return self._model_path

    @property
    def tokenizer(self) -> Any:
        """The model's mlx-lm ``TokenizerWrapper`` (loads the model if needed)."""
        self.start()
        return self._runner.tokenizer

    def start(self, timeout: float | None = None) -> Engine:
        """Start the engine thread and wait until the model is loaded (or failed)."""
        self._ensure_thread()
        if not self._loaded.wait(timeout):
            raise TimeoutError("the model did not load within the timeout")
        self._raise_if_unusable()
        return self

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        on_token: TokenCallback | None = None,
        timeout: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RequestHandle:
        """Queue a request and return its handle at once (never blocks on the model).

        ``prompt`` is text, token ids, or chat messages (rendered with the chat template).
        ``on_token(token_id, text_delta)`` runs on the engine thread; returning False
        stops the row, raising fails it. ``timeout`` (seconds) cancels it when passed.
        ``tools`` (OpenAI function format) need a chat-messages prompt; ``tool_choice``
        is "auto", "none", "required"/"any" or a tool name, and the last two are enforced
        by a grammar. Invalid tools, tool choices or constraints raise here, at once.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if isinstance(prompt, (bytes, bytearray)) or prompt is None:
            raise TypeError("prompt must be text, a list of token ids, or chat messages")
        specs = normalize_tools(tools)
        choice = normalize_tool_choice(tool_choice, specs)
        if specs and choice != "none" and not _is_chat(prompt):
            raise ValueError("tools need a chat-messages prompt")
        forced = bool(specs) and choice not in ("auto", "none")
        if forced and params.constraint is not None:
            raise ValueError("a forced tool_choice cannot be combined with a constraint")
        if forced:  # checks the tools' schemas now; rebuilt for the tokenizer at admission
            validate_constraint(forced_call_grammar(specs, choice, parallel_tool_calls))
        elif params.constraint is not None:
            validate_constraint(params.constraint)
        now = time.monotonic()
        stream = RequestStream()
        with self._lock:
            self._raise_if_unusable()
            request_id = next(self._ids)
            row = Row(request_id, prompt, params, stream, on_token, now,
                      None if timeout is None else now + timeout,
                      tools=specs, tool_choice=choice, parallel_tool_calls=parallel_tool_calls,
                      template_kwargs=dict(chat_template_kwargs or {}))
            self._commands.put(_Submit(row))
        self._ensure_thread()
        return RequestHandle(request_id, stream, lambda: self._commands.put(_Cancel(request_id)))

    def count_tokens(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> int:
        """Prompt tokens ``submit`` would use for this prompt (loads the model if needed)."""
        self.start()
        encoded = self._runner.prompts.encode_request(
            prompt, normalize_tools(tools), dict(chat_template_kwargs or {}))
        return len(encoded.ids)

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
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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

    # ----- the engine thread ----------------------------------------------------------

    def _main(self) -> None:
        try:
            self._load()
            self._loaded.set()
            while self._serve_once():
                pass
        except BaseException as exc:  # every waiter must learn of it
            self._die(exc)
        finally:
            self._loaded.set()
            self._release_mlx()

    def _load(self) -> None:
        from engine.runner import Runner

        path = self.model_path
        self._runner = Runner(path, self.config)
        footprint = self._runner.load()
        store = self._runner.reuse.store
        # Cached prefixes count against the KV budget and are the first thing to give way.
        self._scheduler = Scheduler(footprint, self.config.max_batch, self.config.kv_budget_bytes,
                                    cache_bytes=lambda: store.nbytes, reclaim=store.shrink_to)
        with self._stats_lock:
            self._stats.loaded = True
            self._stats.batch_mode = self._scheduler.mode.value
            self._stats.context_limit = footprint.context_limit
        if self._scheduler.mode is BatchMode.SERIAL:
            log.warning("model caches (%s) cannot batch: requests run one at a time",
                        ", ".join(footprint.non_batchable_kinds))

    def _serve_once(self) -> bool:
        scheduler = self._scheduler
        assert scheduler is not None
        for command in self._take_commands(block=scheduler.is_idle()):
            if isinstance(command, _Shutdown):
                self._shutdown()
                return False
            if isinstance(command, _Submit):
                self._accept(command.row)
            elif command.request_id in self._rows:
                scheduler.cancel(command.request_id)
        self._expire_deadlines()
        self._apply(scheduler.plan())
        if self._runner.batch_rows:
            self._step(self._runner.step, serial=False)
        if self._runner.serial_request is not None:
            self._step(self._runner.step_serial, serial=True)
        self._publish_stats()
        return True

    def _take_commands(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_wait()))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _idle_wait(self) -> float | None:
        # Sleep until the next command, or until the nearest deadline must fire.
        deadlines = [r.deadline for r in self._rows.values() if r.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self, row: Row) -> None:
        assert self._scheduler is not None
        try:
            tools = row.tools if row.tool_choice != "none" else ()
            encoded = self._runner.prompts.encode_request(row.prompt, tools, row.template_kwargs)
            row.prompt_ids, row.head_len = encoded.ids, encoded.head_len
            if tools and row.tool_choice != "auto":
                row.params = replace(row.params, constraint=self._runner.forced_call_constraint(
                    tools, row.tool_choice, row.parallel_tool_calls))
            self._runner.check_constraint(row.params)
            kv_bytes = self._scheduler.validate(len(row.prompt_ids), row.params.max_tokens)
        except Exception as exc:  # a bad request fails alone
            self._rows[row.request_id] = row
            self._finish(row, FinishReason.ERROR, error=exc)
            return
        row.text = RowText(self._runner.new_detokenizer(), row.params.stop)
        row.channels = RowChannels(ChannelSplitter(self._runner.prompts.channel_markers(),
                                                   encoded.start_channel),
                                   self._runner.prompts.tool_parser, row.tools)
        row.stop_ids = self._runner.stop_token_ids(row.params)
        self._rows[row.request_id] = row
        lane = self._scheduler.lane_for(row.params.needs_serial_lane)
        self._scheduler.enqueue(
            Ticket(row.request_id, len(row.prompt_ids), row.params.max_tokens, kv_bytes, lane)
        )
        row.queued = True

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
        if not plan:
            return
        for request_id in plan.dropped:
            self._finish_cancelled(self._rows[request_id])
        if plan.evict:
            serial = self._runner.serial_request
            if serial in plan.evict:
                self._runner.stop_serial()
            self._runner.remove([r for r in plan.evict if r != serial])
            for request_id in plan.evict:
                self._finish_cancelled(self._rows[request_id])
        specs = [self._spec(ticket) for ticket in plan.admit]
        self._runner.insert(specs)
        self._note_cached_tokens()
        if plan.serial is not None:
            specs.append(self._spec(plan.serial))
            self._runner.start_serial(specs[-1])
        with self._stats_lock:
            self._stats.prompt_tokens += sum(len(spec.prompt) for spec in specs)

    def _note_cached_tokens(self) -> None:
        for request_id, cached in self._runner.take_cached_tokens().items():
            row = self._rows.get(request_id)
            if row is not None:
                row.cached_tokens = cached

    def _spec(self, ticket: Ticket) -> Any:
        from engine.runner import RowSpec

        row = self._rows[ticket.request_id]
        row.admitted = True
        return RowSpec(row.request_id, row.prompt_ids, row.params, row.head_len)

    def _step(self, run: Any, serial: bool) -> None:
        try:
            result = run()
        except Exception as exc:  # contained below, or fatal after retries
            self._model_failure(exc, serial)
            return
        self._consecutive_failures = 0
        self._note_cached_tokens()
        with self._stats_lock:
            self._stats.steps += 1
            self._stats.peak_running = max(self._stats.peak_running, result.decoding_rows)
            self._stats.generated_tokens += len(result.tokens)
        for request_id, error in result.failed.items():
            self._evict(request_id)
            self._finish(self._rows[request_id], FinishReason.ERROR, error=error)
        for out in result.tokens:
            row = self._rows.get(out.request_id)
            if row is not None:
                self._deliver(row, out.token, out.finish, out.logprob)

    def _deliver(
        self, row: Row, token: int, finish: FinishReason | None, logprob: TokenLogprob | None
    ) -> None:
        runner_holds_row = finish is None  # stops decided here must evict it
        delta, ids, finish = row.take_token(token, finish, time.monotonic())
        if logprob is not None and ids:
            row.logprobs.append(logprob)
        if row.on_token is not None:
            try:
                if row.on_token(token, delta) is False and finish is None:
                    finish = FinishReason.STOP
            except Exception as exc:  # fails this row's consumer only
                if runner_holds_row:
                    self._evict(row.request_id)
                self._finish(row, FinishReason.ERROR, error=exc)
                return
        lp = (logprob,) if logprob is not None else None
        if finish is None:
            row.stream.publish(row.event(delta, ids, lp))
            return
        if runner_holds_row:
            self._evict(row.request_id)
        self._finish(row, finish, delta=delta, token_ids=ids, logprobs=lp)

    def _evict(self, request_id: int) -> None:
        """Remove a row the runner still holds (stopped by text, callback or failure)."""
        if self._runner.serial_request == request_id:
            self._runner.stop_serial()
        else:
            self._runner.remove([request_id])
        assert self._scheduler is not None
        self._scheduler.release(request_id)

    def _finish_cancelled(self, row: Row) -> None:
        self._finish(row, FinishReason.CANCELLED, error=row.cancel_error)

    def _finish(
        self,
        row: Row,
        reason: FinishReason,
        *,
        error: BaseException | None = None,
        delta: str = "",
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        self._rows.pop(row.request_id, None)
        if self._scheduler is not None:
            self._scheduler.release(row.request_id)
        event, completion = row.final(reason, error, delta, token_ids, logprobs)
        with self._stats_lock:
            if reason is FinishReason.ERROR:
                self._stats.failed += 1
            elif reason is FinishReason.CANCELLED:
                self._stats.cancelled += 1
            else:
                self._stats.completed += 1
            # Before the consumer wakes, so whoever holds a result sees its row gone; one
            # row at a time, so the counts agree with completed/cancelled at every moment.
            if row.admitted:
                self._stats.running = max(0, self._stats.running - 1)
            elif row.queued:
                self._stats.pending = max(0, self._stats.pending - 1)
        row.stream.publish(event, completion)

    def _model_failure(self, exc: Exception, serial: bool) -> None:
        """A model step failed: fail the rows in flight, then recover or die."""
        log.error("model step failed: %r", exc)
        self._consecutive_failures += 1
        if serial:
            failed = [self._runner.serial_request]
            self._runner.stop_serial()
        else:
            failed = self._runner.reset_batch()
        for request_id in failed:
            row = self._rows.get(request_id)
            if row is not None:
                error = EngineError(f"the model step failed: {exc!r}")
                error.__cause__ = exc
                self._finish(row, FinishReason.ERROR, error=error)
        if self._consecutive_failures >= self.config.max_consecutive_step_failures:
            raise EngineDeadError(
                f"{self._consecutive_failures} model steps failed in a row; last: {exc!r}"
            ) from exc

    def _publish_stats(self) -> None:
        assert self._scheduler is not None
        with self._stats_lock:
            self._stats.running = self._scheduler.running
            self._stats.pending = self._scheduler.pending
            self._stats.kv_bytes_projected = self._scheduler.kv_bytes_projected
            self._stats.live_matchers = self._runner.live_matchers
            store = self._runner.reuse.store
            self._stats.prefix_hits = store.stats.hits
            self._stats.prefix_misses = store.stats.misses
            self._stats.prefix_hit_tokens = store.stats.hit_tokens
            self._stats.prefix_evictions = store.stats.evictions + store.stats.expirations
            self._stats.prefix_bytes = store.nbytes
            self._stats.prefix_entries = len(store)

    def _shutdown(self) -> None:
        error = EngineClosedError("the engine was closed while the request ran")
        self._runner.close()
        self._fail_everything(error, FinishReason.CANCELLED)
        self._publish_stats()

    def _die(self, exc: BaseException) -> None:
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine thread died: {exc!r}"
        )
        if dead is not exc:
            dead.__cause__ = exc
        log.error("engine is dead: %r", exc)
        with self._lock:
            self._dead = dead
        if self._runner is not None:
            try:
                self._runner.close()
            except Exception:  # best effort on the way out
                log.exception("releasing rows after the engine died failed")
        self._fail_everything(dead, FinishReason.ERROR)
        if self._scheduler is not None:
            self._publish_stats()

    def _fail_everything(self, error: BaseException, reason: FinishReason) -> None:
        # Rows known to the engine thread, then submits still sitting in the queue.
        if self._scheduler is not None:
            self._scheduler.drain()
        for row in list(self._rows.values()):
            self._finish(row, reason, error=error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                self._finish(command.row, reason, error=error)

    def _release_mlx(self) -> None:
        self._runner = _ReleasedRunner()
        try:
            import mlx.core as mx

            mx.clear_streams()  # without it, processes aborted at exit (DESIGN.md)
        except Exception:  # best effort on the way out
            pass


class _ReleasedRunner:
    """Stands in after the thread ended so late attribute reads fail clearly."""

    def __getattr__(self, name: str) -> Any:
        raise EngineClosedError("the engine is closed")


def _is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)


def _resolve(spec: ModelSpec, config: EngineConfig) -> Path:
    if spec is not None and Path(spec).is_dir():
        return Path(spec)  # a local model directory needs no resolution
    from engine.models import resolve_model

    return resolve_model(spec, quantized=config.quantized)


@atexit.register
def _close_all_engines() -> None:
    for engine in list(_live_engines):
        engine.close(timeout=5.0)
