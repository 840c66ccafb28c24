"""Ollama's requests with nothing to generate: they load the model, or unload it.

A ``/api/chat`` without messages, or a ``/api/generate`` with nothing to continue, loads
the model and answers ``done_reason: "load"`` (clients send it to warm a model up); with
``keep_alive`` 0 it unloads the model instead (``ollama stop``) and answers ``"unload"``.
The engine sets a model's idle deadline from the requests it runs (the latest request's
``keep_alive`` applies, as in Ollama; one without brings back ``--keep-alive``), so a load
or an unload is a one-token request: the model is loaded for it, then kept for the
request's ``keep_alive`` (none: the configured one, so a load after ``keep_alive`` 0 does
not unload again at once), or unloaded once the engine is idle when that is 0. An unload
of a model that is not loaded does nothing.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from engine import EngineError, SamplingParams, TextRequest
from mlx_providers._keep_alive import submit_options
from mlx_providers.server.errors import from_engine
from mlx_providers.server.ollama_answer import Kind, Timing, created_at
from mlx_providers.server.served import ServedModel

# The one-token request that loads the model and carries a keep_alive to the engine.
_CARRIER = TextRequest("\n", SamplingParams(max_tokens=1))


async def load_or_unload(served: ServedModel, kind: Kind, model: str,
                         keep_alive: float | None) -> Response:
    """Load (or, ``keep_alive`` 0, unload) ``served``'s model; Ollama's answer to it."""
    timing = Timing(served.engine)
    engine = served.engine
    unloading = keep_alive == 0
    try:
        if not (unloading and not engine.stats().loaded):
            slot = served.admit()
            try:
                await engine.submit(_CARRIER, **submit_options(keep_alive)).aresult()
            finally:
                slot.release()
    except (EngineError, ValueError, TypeError) as exc:
        raise from_engine(exc) from exc
    empty: dict[str, Any] = ({"response": ""} if kind == "generate" else
                             {"message": {"role": "assistant", "content": ""}})
    return JSONResponse({"model": model, "created_at": created_at(), **empty, "done": True,
                         "done_reason": "unload" if unloading else "load",
                         **timing.durations()})
