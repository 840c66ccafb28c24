"""Engine: the public facade over one engine thread (``engine.runtime``).

Every call here runs on the caller's thread: it checks its arguments and hands a request
to the runtime's command queue, or reads a snapshot. All MLX work (loading, steps,
embeddings) happens on the engine thread; see ``engine/runtime/runtime.py``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.compatibility import check_combination
from engine.config import EngineConfig, ModelSpec, checked_engine_args
from engine.core.keep_alive import CONFIGURED, KeepAliveArg, check_keep_alive
from engine.core.stats import EngineStats
from engine.core.step_probe import StepProbe
from engine.core.streams import RequestHandle
from engine.distributed.protocol import check_replicable
from engine.embedding.request import EmbeddingHandle, EmbeddingRequest, Embeddings, check_texts
from engine.models import config_context_limit
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.sampling import TokenCallback, check_callbacks
from engine.requests.inbound.text_request import Request, TextRequest
from engine.requests.prepare import ImageSupport, checked_request
from engine.runtime.runtime import Runtime

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
        self._runtime = Runtime(model, self.config, probe)
        self._embedding_paths: dict[ModelSpec, Path] = {}
        self._embedding_lock = threading.Lock()  # a first call may download: once
        _live_engines.add(self)

    @property
    def model_path(self) -> Path:
        """The resolved local model directory (what ``mlx_lm.load`` would load)."""
        return self._runtime.model_path

    @property
    def tokenizer(self) -> Any:
        """The model's mlx-lm ``TokenizerWrapper`` (loads the model the first time; kept
        while keep_alive has the weights unloaded)."""
        return self._runtime.preparer().tokenizer

    def start(self, timeout: float | None = None) -> Engine:
        """Start the engine thread and wait until the model is loaded (loaded again, if
        ``keep_alive`` had unloaded it).

        A model that cannot load raises ``ModelLoadError`` naming it and the cause: a
        ``ModelUnavailableError`` (an ``OSError``: a missing path, the hub, an unreadable
        file) or a ``ModelFormatError`` (a ``ValueError``: an unknown architecture, a
        corrupt config). The engine is dead then; a new one may try again.
        """
        self._runtime.start(timeout)
        return self

    def submit(self, request: Request, *, on_token: TokenCallback | None = None,
               timeout: float | None = None,
               keep_alive: KeepAliveArg = CONFIGURED) -> RequestHandle:
        """Queue a request and return its handle at once (never blocks on the model).

        ``request`` is a ``ChatRequest`` (messages rendered with the chat template, with
        tools and a tool choice: ``ChatRequest.from_openai(messages, params, tools=...)``)
        or a ``TextRequest`` (text or token ids, no template: ``TextRequest(prompt,
        params)``); each was checked when it was built. ``on_token(token_id, text_delta)``
        runs on the engine thread; returning False stops the row, raising fails it.
        ``timeout`` (seconds) cancels it when passed. A constraint or a forced tool call
        that cannot compile raises here, at once.

        ``keep_alive``: seconds the chat model stays loaded once the engine is idle after
        this request (0: unload right after it; None: keep it loaded), as Ollama's
        ``keep_alive``; the latest request's applies to the engine, and one that sets none
        brings back ``EngineConfig.keep_alive``. Not on a sharded engine.
        """
        check_callbacks(on_token, timeout)
        if isinstance(request, ChatRequest | TextRequest):
            # Pairs the engine does not serve together are refused first, by one table
            # (before an adapter's files are read for a pair that can never run).
            check_combination(request, self.config.shard, keep_alive is not CONFIGURED)
        checked = checked_request(request)
        if keep_alive is CONFIGURED:
            seconds = self.config.keep_alive
        else:
            seconds = check_keep_alive(keep_alive)
        if self.config.shard is not None:
            check_replicable(checked.params)  # never reaches the other ranks
        return self._runtime.submit(checked, on_token, timeout, seconds)

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
        request = self._runtime.embed(lambda request_id: EmbeddingRequest(
            request_id, checked, path, embedding_model_name(model), now,
            None if timeout is None else now + timeout))
        if not checked:  # nothing to run: no vectors, and no model loaded for it
            request.finish(Embeddings(np.zeros((0, 0), np.float32), 0, request.model_name))
        return EmbeddingHandle(request)

    def embedding_model_path(self, model: ModelSpec = None) -> Path:
        """The local directory of an embedding model, downloading the default once."""
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(f"model must be None, a path or a hub id, got "
                            f"{type(model).__name__}")
        with self._embedding_lock:
            path = self._embedding_paths.get(model)
            if path is None:
                from engine.models.embedding_model import resolve_embedding_model

                path = self._embedding_paths[model] = resolve_embedding_model(model)
            return path

    def count_tokens(self, request: Request) -> int:
        """Prompt tokens ``submit`` would use for this request (loads the model the first
        time; never reloads one keep_alive unloaded)."""
        checked = checked_request(request)
        return self._runtime.preparer().count_tokens(checked)

    @property
    def context_limit(self) -> int | None:
        """The model's context limit in tokens, without loading the weights."""
        limit = self.stats().context_limit
        return limit if limit is not None else config_context_limit(self.model_path)

    @property
    def image_support(self) -> ImageSupport:
        """Whether this model's image parts are served, and if not why (decided at load,
        from its checkpoint: ``docs/models.md``'s vision table lists every family)."""
        return self._runtime.preparer().image_support

    def stats(self) -> EngineStats:
        """A consistent snapshot of the engine's counters (safe from any thread)."""
        return self._runtime.book.snapshot()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel everything in flight, stop the thread, release the model."""
        self._runtime.close(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def serves_chat(self) -> bool:
        """Whether chat has been asked of this engine (its chat model loads, or has loaded)."""
        return self._runtime.chat_wanted

    @property
    def usable(self) -> bool:
        """False once the engine is closed or dead (every call would then raise)."""
        return self._runtime.usable


@atexit.register
def _close_all_engines() -> None:
    for engine in list(_live_engines):
        engine.close(timeout=5.0)
