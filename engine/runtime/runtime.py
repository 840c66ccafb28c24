"""The engine thread: one thread that owns all MLX work, fed by a command queue.

Callers on any thread only enqueue commands (``engine.runtime.commands``). The thread
loads the chat model once chat is asked for (an engine used only for embeddings never
loads it), then runs one turn at a time (``engine.runtime.turns``): commands to the step
core, the core's turn, at most one due embedding batch, the turn's stats. It blocks on
the queue when idle. With ``keep_alive``, a model idle that long is unloaded
(``engine.runtime.unload``) and the thread serves embeddings only, as before the first
load, until a request or ``start()`` wants the model again; that request waits for the
load. Its endings are three: a shutdown (``close``), a death (a load that failed, a step
that failed too often, a rank gone), and, for a sharded engine whose step never returned,
abandonment from the watchdog. Every waiter learns of each.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelSpec
from engine.core.keep_alive import KeepAlive
from engine.core.rows import Row
from engine.core.stats import StatsBook
from engine.core.step_core import end_row
from engine.core.step_probe import StepProbe
from engine.core.streams import RequestHandle, RequestStream
from engine.core.update import Ending
from engine.distributed.group import shard_group
from engine.embedding.request import EmbeddingRequest
from engine.embedding.service import EmbeddingService
from engine.errors import EngineClosedError, EngineDeadError
from engine.models import model_path_for
from engine.requests.inbound.sampling import TokenCallback
from engine.requests.inbound.text_request import Request
from engine.requests.outbound.results import FinishReason
from engine.runtime.build import Composition, Kept, build_model, compose_core
from engine.runtime.commands import (
    Cancel,
    CommandQueue,
    Embed,
    Shutdown,
    Submit,
    WantChat,
)
from engine.runtime.load_errors import load_error
from engine.runtime.turns import Turns, embedding_figures, weight_figures
from engine.runtime.unload import freeze_live, release_memory, unload

if TYPE_CHECKING:
    from engine.requests.prepare import Preparer

log = logging.getLogger("engine")


class Runtime:
    """The engine thread, its command queue, and how it starts and ends.

    State a caller's thread reads (``usable``, the dead error) is guarded by ``_lock``;
    everything else below the loaded model is touched only by the engine thread.
    """

    def __init__(self, model: ModelSpec, config: EngineConfig,
                 probe: StepProbe | None) -> None:
        self.model_spec = model
        self.config = config
        self.book = StatsBook()  # the one writer of stats(), safe from any thread
        self.embeddings = EmbeddingService(
            config.embed_window, config.embed_max_batch, config.embed_share,
            before_encode=None if probe is None else probe.before_embed)
        self._probe = probe
        self._commands = CommandQueue()
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._closed = False
        self._dead: BaseException | None = None
        self._abandoned = False  # a sharded step never returned (see abandon)
        self._model_path: Path | None = None
        self._chat_wanted = False  # set by start()/submit(); until then only embeddings run
        self._touched_mlx = False
        self._turns: Turns | None = None  # the chat loop, while the model is loaded
        self._keep_alive = KeepAlive(config.keep_alive)  # engine thread only
        self._kept: Kept | None = None  # what the last unload left for the next load
        self._preparer: Preparer | None = None  # from the first load on; kept by unloads

    # ----- what the facade asks, from any thread --------------------------------------------

    @property
    def model_path(self) -> Path:
        """The resolved local model directory (resolving may download and convert)."""
        # Its own lock: resolving may take long, and submit must not wait on it.
        with self._resolve_lock:
            if self._model_path is None:
                self._model_path = model_path_for(self.model_spec, self.config.quantized)
            return self._model_path

    @property
    def chat_wanted(self) -> bool:
        return self._chat_wanted

    @property
    def usable(self) -> bool:
        return self._dead is None and not self._closed

    @property
    def composition(self) -> Composition | None:
        """The loaded engine (read-only for callers once ``start`` returned)."""
        return self._turns.composition if self._turns is not None else None

    def raise_if_unusable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def start(self, timeout: float | None) -> None:
        """Start the thread if needed and wait until the chat model is loaded (or failed):
        loads it again if keep_alive unloaded it."""
        with self._lock:
            self._chat_wanted = True
            if self._thread is not None and not self._loaded.is_set():
                # A thread serving only embeddings (chat not asked for yet, or unloaded):
                # wake it. A loop already loading ignores this.
                self._commands.put(WantChat())
        self._ensure_thread()
        if not self._loaded.wait(timeout):
            raise TimeoutError("the model did not load within the timeout")
        self.raise_if_unusable()

    def preparer(self) -> Preparer:
        """The model's request preparer and tokenizer: loads the model the first time;
        kept while keep_alive has it unloaded. Raises once the engine is closed."""
        if self._preparer is None:
            self.start(None)
        if self._preparer is None or self._closed:
            raise EngineClosedError("the engine is closed")
        return self._preparer

    def submit(self, request: Request, on_token: TokenCallback | None,
               timeout: float | None, keep_alive: float | None) -> RequestHandle:
        """Queue a checked request as a row; its handle at once. ``keep_alive``: seconds the
        model stays loaded once idle after it (None: keep it loaded)."""
        now = time.monotonic()
        stream = RequestStream()
        with self._lock:
            self.raise_if_unusable()
            request_id = next(self._ids)
            row = Row(request_id, request, stream, on_token, now,
                      None if timeout is None else now + timeout)
            self._chat_wanted = True
            self._commands.put(Submit(row, keep_alive))
        self._ensure_thread()
        return RequestHandle(request_id, stream, lambda: self._commands.put(Cancel(request_id)))

    def embed(self, build: Callable[[int], EmbeddingRequest]) -> EmbeddingRequest:
        """Queue the embedding request ``build(request_id)`` makes (none for no texts)."""
        with self._lock:
            self.raise_if_unusable()
            request = build(next(self._ids))
            if request.texts:
                self.embeddings.register(request)  # what abandon fails from the watchdog
                self._commands.put(Embed(request))
        if request.texts:
            self._ensure_thread()
        return request

    def close(self, timeout: float | None) -> None:
        """Cancel everything in flight, stop the thread, release the model."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(Shutdown())
            thread = None if self._abandoned else self._thread  # stuck in a collective
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self.raise_if_unusable()
                self._thread = threading.Thread(
                    target=self._main, name=f"mlx-engine-{id(self):x}", daemon=True
                )
                self._thread.start()

    # ----- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            # Closed before anyone asked for the chat model, or after keep_alive unloaded
            # it: the loop ends without (re)loading it.
            wanted = self._chat_wanted or self._serve_without_chat()
            while wanted:
                try:
                    turns = self._load()
                except Exception as exc:  # the caller's to fix: its message names the model
                    self._die(load_error(exc, self.model_spec))
                    return
                self._loaded.set()
                if not self._serve_loaded(turns):
                    return  # shut down
                del turns  # the unload must hold the model's last reference
                self._unload()
                wanted = self._serve_without_chat()
        except BaseException as exc:  # every waiter must learn of it
            self._die(exc)
        finally:
            self._loaded.set()
            self._close_prefix_writes()
            if self._touched_mlx:
                from engine.device.loading.loader import release_streams

                release_streams()

    def _load(self) -> Turns:
        """Load the chat model: the first time, or again from what an unload kept."""
        self._touched_mlx = True  # importing mlx gives this thread a stream to release
        if self._probe is not None:
            self._probe.model_stage("loading")
        started = time.perf_counter()
        built = build_model(self.model_path, self.config, shard_group(self.config),
                            self._kept)
        self._kept = None
        if self._probe is not None:
            self._probe.lanes_built(built.lanes)
        composition = compose_core(built, self.config, self.book, self._probe,
                                   on_hang=self.abandon)
        self._preparer = built.preparer
        self._turns = Turns(composition, self.config, self.book, self.embeddings,
                            self._probe, self._keep_alive)
        # What the load built lives as long as the model: frozen now, the collections
        # while the first rows decode do not scan it (``freeze_live``).
        freeze_live()
        self.book.add(loads=1)
        self.book.set(last_load_seconds=time.perf_counter() - started)
        self._keep_alive.used(time.monotonic())  # the idle clock starts at the load
        return self._turns

    def _serve_loaded(self, turns: Turns) -> bool:
        """Serve the loaded model: False once the engine shut down, True once it has been
        idle (nothing running, waiting or queued) for its keep_alive."""
        while self._serve_once(turns):
            turns.collect_when_idle()
            if (turns.idle and not self._commands.waiting
                    and self._keep_alive.due(time.monotonic())):
                return True
        return False

    def _unload(self) -> None:
        """Release the idle chat model: weights, lanes, in-memory prefixes, MLX's buffer
        cache. The preparer (tokenizer), the prefix disk tier and the counters stay."""
        turns = self._turns
        assert turns is not None
        if self._probe is not None:
            self._probe.model_stage("unloading")
        with self._lock:
            self._loaded.clear()  # start() from here on wakes the thread to load again
        self._kept = unload(turns.composition)
        self._turns = None
        del turns  # the model's last reference: release_memory can free it
        # The gauges first, the count last: whoever sees the unload counted sees it done.
        self.book.set(loaded=False, prefix_bytes=0, prefix_entries=0, **release_memory(),
                      **weight_figures(self.embeddings, 0, 0))
        self.book.add(unloads=1)
        log.info("keep_alive: the chat model was idle for %s s and is unloaded",
                 self._keep_alive.seconds)

    def _close_prefix_writes(self) -> None:
        """The engine is going away: stored prefixes still on their way to disk are written."""
        try:
            composition = self.composition
            if composition is not None:
                composition.built.lanes.close()
            elif self._kept is not None:  # unloaded: the disk tier is what it kept
                self._kept.close()
        except Exception:
            log.exception("closing the lanes failed")

    def _serve_once(self, turns: Turns) -> bool:
        """One turn of the loaded engine; False once it shut down."""
        idle = turns.idle
        commands = self._commands.take(block=idle, wait=turns.idle_wait(),
                                       window=self.config.admission_window,
                                       burst=self.config.prefill_batch)
        if idle:
            turns.heartbeat_if_due()  # raises EngineDeadError if a follower is gone
        stop = next((i for i, c in enumerate(commands) if isinstance(c, Shutdown)), None)
        turns.take(commands if stop is None else commands[:stop])
        if stop is not None:
            self._shutdown()
            return False
        turns.turn()
        return True

    def _serve_without_chat(self) -> bool:
        """Serve embeddings while the chat model is not loaded (not asked for yet, or
        unloaded by keep_alive) until chat is wanted (True) or the engine closes (False)."""
        while True:
            due = self.embeddings.due_at()
            commands = self._commands.take(
                block=True, wait=None if due is None else max(0.0, due - time.monotonic()))
            for command in commands:
                if isinstance(command, Shutdown):
                    self._fail_everything(
                        EngineClosedError("the engine was closed while the request ran"),
                        FinishReason.CANCELLED)
                    return False
                if isinstance(command, Embed):
                    self.embeddings.add(command.request)
                elif isinstance(command, Cancel) and not self._commands.holding:
                    continue  # its row ended before the model was unloaded: nothing to load
                else:  # a chat request: the chat loop takes it and the rest in order
                    self._commands.hold(command)
            if self.embeddings.pending:
                self._touched_mlx = True  # an encoder may be loaded and run on this thread
                self.embeddings.run_due()
                self.book.set(**embedding_figures(self.embeddings),
                              **weight_figures(self.embeddings, 0, 0))
            if self._commands.holding:
                return True

    # ----- endings ------------------------------------------------------------------------

    def _shutdown(self) -> None:
        error = EngineClosedError("the engine was closed while the request ran")
        self._reset_lanes()
        self._fail_everything(error, FinishReason.CANCELLED)
        turns = self._turns
        if turns is not None:
            if turns.composition.link is not None:
                turns.composition.link.shutdown()  # a sharded engine's followers stop too
            turns.publish_stats()

    def _die(self, exc: BaseException) -> None:
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine thread died: {exc!r}")
        if dead is not exc:
            dead.__cause__ = exc
        log.error("engine is dead: %r", dead)
        with self._lock:
            self._dead = dead
        try:
            self._reset_lanes()
        except Exception:  # best effort on the way out
            log.exception("releasing rows after the engine died failed")
        self._fail_everything(dead, FinishReason.ERROR)
        turns = self._turns
        if turns is not None:
            if turns.composition.link is not None:
                try:
                    turns.composition.link.shutdown()  # followers stop, unless one failed
                except Exception:
                    log.exception("stopping the followers failed")
            turns.publish_stats()

    def abandon(self, dead: EngineDeadError) -> None:
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
        failed = self.embeddings.fail_registered(dead)
        self._fail_everything(dead, FinishReason.ERROR, engine_thread=False)
        self.book.set(running=0, pending=0, embed_pending=0)
        self.book.add(embed_failed=failed)

    def _reset_lanes(self) -> None:
        """Release every row (and its grammar matcher): the engine is going away."""
        composition = self.composition
        if composition is not None:
            composition.built.lanes.batch.reset()
            composition.built.lanes.serial.reset()

    def _fail_everything(self, error: BaseException, reason: FinishReason, *,
                         engine_thread: bool = True) -> None:
        """Fail every row and request; ``engine_thread=False`` (the watchdog) leaves the
        embedding batcher and counters alone: its caller failed those requests already."""
        # Rows known to the engine thread, then submits still sitting in the queue.
        composition = self.composition
        if composition is not None:
            composition.core.fail_rows(error, reason)
        for command in self._commands.drain():
            if isinstance(command, Submit):
                end_row(Ending(command.row, reason, error), self.book)
            elif (isinstance(command, Embed) and command.request.finish(error=error)
                  and engine_thread):
                self.embeddings.counters.failed += 1
        if engine_thread:
            self.embeddings.fail_all(error)

