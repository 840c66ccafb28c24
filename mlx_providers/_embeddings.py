"""What both embedding faces do: check the input, ask the process's embedding engine.

Framework-free, so the LangChain and LlamaIndex classes only wire these. The engine is
looked up per call (``engine.get_embedding_engine``): embeddings run on the engine that
already serves chat in this process, between its decode steps.
"""

from __future__ import annotations

import os
from typing import Any

import anyio

from engine import Engine, check_texts, get_embedding_engine

EmbeddingModel = str | os.PathLike[str] | None


def check_model(model: Any) -> str | None:
    """An embedding model spec as text (paths too), or a ``TypeError``/``ValueError``."""
    if model is None:
        return None
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise TypeError(f"model must be None (all-MiniLM-L6-v2), a path or a hub id, got "
                        f"{type(model).__name__}")
    if not model.strip():
        raise ValueError("model must not be empty: a path, a hub id, or None for the default")
    return model


def check_query(text: Any) -> str:
    """One text to embed; a list or bytes here is a ``TypeError`` naming the right method."""
    if not isinstance(text, str):
        raise TypeError(f"the query must be a str, got {type(text).__name__} (several texts "
                        "go to the documents/batch method)")
    return text


def embed(texts: Any, model: str | None, timeout: float | None) -> list[list[float]]:
    """Unit vectors for ``texts`` (validated here, on the caller's thread)."""
    checked = check_texts(texts)
    if not checked:
        return []
    return get_embedding_engine().embed(checked, model, timeout=timeout).result().tolist()


async def aembed(texts: Any, model: str | None, timeout: float | None) -> list[list[float]]:
    """``embed`` without blocking the event loop; cancelling the task cancels the request."""
    checked = check_texts(texts)
    if not checked:
        return []
    engine = get_embedding_engine()
    await _resolved(engine, model)
    handle = engine.embed(checked, model, timeout=timeout)
    return (await handle.aresult()).tolist()


async def _resolved(engine: Engine, model: str | None) -> None:
    # The first call may download and unpack the model: in a worker thread, not the loop.
    await anyio.to_thread.run_sync(engine.embedding_model_path, model)
