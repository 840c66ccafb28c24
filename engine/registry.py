"""One engine per model per process, so every adapter instance shares one batch."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, ModelSpec
from engine.engine import Engine

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _key(model: ModelSpec) -> str:
    if model is None:
        return "<default>"
    text = os.fspath(model)
    path = Path(text).expanduser()
    # The same directory reached by different spellings is the same weights.
    return str(path.resolve()) if path.exists() else text


def get_engine(model: ModelSpec = None, **config: Any) -> Engine:
    """The process-wide engine for ``model``, created lazily and thread-safely.

    Keyword arguments are ``EngineConfig`` fields. Asking again for the same model
    with a different config raises ``ValueError`` instead of loading a second copy of
    the weights; asking with no config returns the existing engine whatever its config.
    """
    wanted = EngineConfig(**config) if config else None
    key = _key(model)
    with _lock:
        engine = _engines.get(key)
        if engine is not None and not engine.usable:
            engine = None
        if engine is None:
            engine = Engine(model, wanted or EngineConfig())
            _engines[key] = engine
        elif wanted is not None and wanted != engine.config:
            raise ValueError(
                f"an engine for {key!r} already exists with a different config "
                f"({_diff(engine.config, wanted)}); reuse it (pass no config), pass the same "
                "config, or close it first"
            )
        return engine


@contextmanager
def shared_engine(model: ModelSpec, engine: Engine) -> Iterator[Engine]:
    """While inside, ``engine`` is the process-wide engine for ``model``: ``get_engine(model)``,
    and so every ``ChatMLXBatch`` and ``MLXBatchLLM`` built for ``model``, uses it.

    For an engine built by hand (with a ``StepProbe``, say) and for tests' scripted
    stand-ins with ``Engine``'s public API. On exit the engine that was shared before, if
    any, is shared again; ``engine`` itself is left open (its owner closes it).
    """
    key = _key(model)
    with _lock:
        before = _engines.get(key)
        _engines[key] = engine
    try:
        yield engine
    finally:
        with _lock:
            if _engines.get(key) is engine:
                if before is None:
                    del _engines[key]
                else:
                    _engines[key] = before


def get_embedding_engine() -> Engine:
    """The engine that runs this process's embeddings (``Engine.embed``), asked per call.

    One engine hosts both kinds of model, so embeddings run between its decode steps and
    never as MLX work on a second thread beside them: the shared engine already serving chat
    if there is one, else the default model's engine, whose chat model loads only if chat
    is asked of it (an embeddings-only process never loads it). A chat engine created later
    for another model takes the next embedding calls over.
    """
    with _lock:
        usable = [engine for engine in _engines.values() if engine.usable]
    chatting = [engine for engine in usable if engine.serves_chat]
    if chatting or usable:
        return (chatting or usable)[0]
    return get_engine()


def _diff(have: EngineConfig, want: EngineConfig) -> str:
    a, b = have.model_dump(), want.model_dump()
    return ", ".join(f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k])


def close_all() -> None:
    """Close every shared engine (tests and interpreter shutdown)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()
