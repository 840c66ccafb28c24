"""``POST /api/embed``: Ollama's embeddings, on the server's embedding models.

``input`` is a string or a list of strings; the answer is ``{"model", "embeddings":
[[...], ...], "total_duration", "load_duration", "prompt_eval_count"}``, one vector per
input, as Ollama's. ``model`` names one of the server's embedding models
(``all-MiniLM-L6-v2`` by default, ``:latest`` accepted); the chat model does not embed
here. As on ``/v1/embeddings``: admission with 429, a client that leaves cancels its
request, texts past the model's length are truncated (``truncate: false`` is accepted but
cannot refuse them: the engine counts tokens after truncating), ``dimensions`` other than
the model's own is refused, and ``keep_alive`` is accepted and ignored (the embedding
model stays loaded).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import check_texts
from mlx_providers.server.context import ServerContext, read_json, validate
from mlx_providers.server.embeddings_endpoint import embedded
from mlx_providers.server.errors import APIError
from mlx_providers.server.generation import CLIENT_CLOSED
from mlx_providers.server.keep_alive import KeepAliveField
from mlx_providers.server.ollama_answer import nanoseconds
from mlx_providers.server.ollama_errors import ollama_route
from mlx_providers.server.ollama_request import OllamaModel, untagged
from mlx_providers.server.served import ServedEmbedding

ENDPOINT = "ollama_embed"


class OllamaEmbedRequest(OllamaModel):
    model: Annotated[str, Field(min_length=1)]
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None  # sampling options mean nothing to an encoder
    keep_alive: KeepAliveField = None
    dimensions: Annotated[int, Field(ge=1)] | None = None


def embedding_model(ctx: ServerContext, name: str) -> ServedEmbedding:
    """The embedding model ``name`` names (``name:latest`` too), or a 404 listing them."""
    served = ctx.embeddings.get(untagged(name, ctx.embeddings.__contains__))
    if served is None:
        chat = " (a chat model: it does not embed here)" if ctx.models.serves(
            untagged(name, ctx.models.serves)) else ""
        raise APIError(404, f"model {name!r} is not an embedding model on this server{chat}; "
                       f"its embedding models are {sorted(ctx.embeddings)}", param="model",
                       code="model_not_found")
    return served


def _texts(value: str | list[str]) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, f"input[{i}] must not be an empty string", param="input")
    try:
        return check_texts(texts)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"input: {exc}", param="input") from exc


@ollama_route(ENDPOINT)
async def ollama_embed(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = validate(OllamaEmbedRequest, await read_json(request, ctx.settings.max_body_bytes))
    served = embedding_model(ctx, body.model)
    started = time.monotonic()
    texts = _texts(body.input)
    if not texts:  # Ollama answers an empty list with no vectors
        return JSONResponse({"model": body.model, "embeddings": [], **_durations(started),
                             "prompt_eval_count": 0})
    result = await embedded(request, ctx, served, texts, ENDPOINT)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    width = result.vectors.shape[1]
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(400, f"dimensions: {served.name} gives {width} dimensions and cannot "
                       "shorten them", param="dimensions")
    ctx.metrics.count(ENDPOINT, "ok")
    return JSONResponse({"model": body.model,
                         "embeddings": [[float(x) for x in row] for row in result.vectors],
                         **_durations(started), "prompt_eval_count": result.prompt_tokens})


def _durations(started: float) -> dict[str, int]:
    # The embedding model is loaded when the server starts and stays: no load to count.
    return {"total_duration": nanoseconds(time.monotonic() - started), "load_duration": 0}
