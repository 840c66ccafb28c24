"""The ASGI app: ``create_app(engine or {name: engine})`` -> a Starlette application.

Mount it in any ASGI server, or run it with ``mlx-providers serve``. The engines are the
caller's: the app never closes them, so in-process users of the same engine
(``ChatMLXBatch``, ``MLXBatchLLM`` through ``get_engine``) share the batch with HTTP clients.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import Engine, EngineError
from mlx_providers.server.anthropic_endpoint import count_tokens, create_message
from mlx_providers.server.anthropic_errors import not_found as anthropic_not_found
from mlx_providers.server.auth import BearerAuth
from mlx_providers.server.chat_endpoint import chat_completions
from mlx_providers.server.completions_endpoint import completions
from mlx_providers.server.context import ServerContext, ServerSettings
from mlx_providers.server.embeddings_endpoint import create_embeddings
from mlx_providers.server.errors import SERVER_ERROR, APIError
from mlx_providers.server.metrics import CONTENT_TYPE, ServerMetrics
from mlx_providers.server.ollama_routes import OLLAMA_ROUTES
from mlx_providers.server.responses_endpoint import (
    create_response,
    delete_response,
    get_response,
)
from mlx_providers.server.responses_store import ResponseStore
from mlx_providers.server.served import EmbeddingModel, ServedEmbedding, ServedModel, ServedModels

log = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what an engine for model=None serves
_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
              "/v1/responses": "responses",
              "/v1/embeddings": "embeddings", "/v1/messages": "messages"}


def served_name(engine: Engine) -> str:
    """The name clients use for an engine's model: as it was given, or the default's."""
    spec = engine.model_spec
    return DEFAULT_MODEL_NAME if spec is None else os.fspath(spec)


def create_app(models: Engine | Mapping[str, Engine], *,
               settings: ServerSettings | None = None,
               store: ResponseStore | None = None,
               embeddings: Mapping[str, EmbeddingModel] | None = None) -> Starlette:
    """An OpenAI-compatible app serving ``models`` (an engine, or engines by name).

    A single engine is served under the model as it was given (a path, a hub id, or
    ``SmolLM2-135M-Instruct`` for the default) and, for a path, its directory name too.
    ``embeddings`` maps names to embedding models (None: all-MiniLM-L6-v2) served at
    ``/v1/embeddings``; they run on the first engine, between its decode steps.
    """
    settings = settings or ServerSettings()
    by_name = _named(models)
    served: dict[str, ServedModel] = {}
    for name, engine in by_name.items():
        one = ServedModel(name, engine, max_queue=settings.max_queue)
        served[name] = one
        alias = Path(name).name
        if isinstance(models, Engine) and alias and alias != name:
            served.setdefault(alias, one)
    served_models = ServedModels(served)
    metrics = ServerMetrics(served_models.engines)
    if store is None:  # (not `store or ...`: an empty store is falsy)
        store = ResponseStore(ttl_seconds=settings.store_ttl_seconds,
                              max_bytes=settings.store_max_bytes)
    host = next(iter(by_name.values()))  # one engine runs chat and embeddings
    served_embeddings = {name: ServedEmbedding(name, host, model, max_queue=settings.max_queue)
                         for name, model in (embeddings or {}).items()}
    ctx = ServerContext(settings, served_models, metrics, store, served_embeddings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for one in served_models:  # load before the first request (in a worker thread)
            await anyio.to_thread.run_sync(one.engine.start)
        for embedding in served_embeddings.values():
            await anyio.to_thread.run_sync(embedding.warm_up)
        yield

    middleware = [Middleware(BearerAuth, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/embeddings", create_embeddings, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/messages/{rest:path}", anthropic_not_found,
              methods=["GET", "POST", "DELETE"]),
        *OLLAMA_ROUTES,  # Ollama's API door: /api/chat, /api/generate, /api/tags...
    ], middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.ctx = ctx
    return app


def _named(models: Engine | Mapping[str, Engine]) -> dict[str, Engine]:
    if isinstance(models, Engine):
        return {served_name(models): models}
    return dict(models)


async def health(request: Request) -> Response:
    """200 when every engine is loaded (or unloaded by keep_alive) and alive; 503 while it
    first loads or once dead."""
    ctx: ServerContext = request.app.state.ctx
    states: dict[str, str] = {}
    for one in ctx.models:
        stats = one.engine.stats()
        if one.engine.usable and stats.unloads and not stats.loaded:
            # keep_alive let it go (or it is loading again): the next request loads it. A
            # probe must not load it back (start() would), nor fail an idle server.
            states[one.name] = "unloaded"
            continue
        try:
            one.engine.start(timeout=0)  # returns at once: loaded, or raises why not
            states[one.name] = "ok"
        except TimeoutError:
            states[one.name] = "loading"
        except EngineError as exc:
            states[one.name] = f"dead: {exc}"
    ok = all(state in ("ok", "unloaded") for state in states.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", "models": states},
                        status_code=200 if ok else 503)


async def prometheus(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    """Every served model once, each with its registered adapters (``base:name``), then
    the embedding models."""
    ctx: ServerContext = request.app.state.ctx
    models = list(ctx.models)  # each model once, though a path is also served by its alias
    names = dict.fromkeys([
        *(one.name for one in models),
        *(f"{one.name}:{adapter}" for one in models for adapter in ctx.settings.adapters),
        *ctx.embeddings])
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "mlx-providers"}
        for name in names]})


def _count(request: Request, status: int) -> None:
    endpoint = _ENDPOINTS.get(request.url.path)
    if endpoint is not None:
        ctx: ServerContext = request.app.state.ctx
        # 529: the Messages door's answer to a full queue (Anthropic's overloaded_error).
        outcome = ("rejected" if status in (429, 529) else
                   "client_error" if status < 500 else "server_error")
        ctx.metrics.count(endpoint, outcome)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    _count(request, exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = APIError(exc.status_code, str(exc.detail),
                     code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error serving %s", request.url.path, exc_info=exc)
    _count(request, 500)
    error = APIError(500, f"internal error: {exc!r}", type=SERVER_ERROR, code=SERVER_ERROR)
    return JSONResponse(error.body(), status_code=500)
