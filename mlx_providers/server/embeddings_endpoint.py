"""``POST /v1/embeddings``: OpenAI's shape (a string or a list of strings in, float or
base64 vectors out, usage), answered by an embedding model hosted on the server's engine.

Input is refused as OpenAI refuses it: an empty string, an empty list, more than 2048
inputs, or anything but strings (token-id arrays are not supported) is a 400 naming
``input``. Texts past the model's ``max_seq_length`` are truncated, not refused.

Requests are admitted as chat requests are (``embed_max_batch + max_queue`` at once per
embedding model, else 429 with ``Retry-After``), and a client that disconnects while its
request waits or runs cancels it: a waiting one never runs, a running one's vectors (and
a split request's remaining chunks) are dropped.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import Embeddings, EngineError, check_texts
from mlx_providers.server.context import ServerContext, read_json, validate
from mlx_providers.server.errors import APIError, from_engine
from mlx_providers.server.generation import ClientGone, unless_disconnected
from mlx_providers.server.served import ServedEmbedding

ENDPOINT = "embeddings"
CLIENT_CLOSED = 499  # as the chat endpoint answers a client that left (never read)




class EmbeddingsRequest(BaseModel):
    """The request body; unknown OpenAI parameters (``user``...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


def _texts(value: Any) -> tuple[str, ...]:
    """The inputs as strings, or a 400 naming ``input`` as OpenAI's does."""
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and all(isinstance(t, int) for t in texts):
        texts = None  # a token-id array
    if isinstance(texts, list) and any(isinstance(t, list) for t in texts):
        texts = None
    if not isinstance(texts, list):
        raise APIError(400, "input must be a string or an array of strings (token-id arrays "
                       "are not supported)", param="input", code="invalid_value")
    if not texts:
        raise APIError(400, "input must not be an empty array", param="input",
                       code="invalid_value")
    try:
        checked = check_texts(texts)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"input: {exc}", param="input", code="invalid_value") from exc
    for i, text in enumerate(checked):
        if not text:
            raise APIError(400, f"input[{i}] must not be an empty string", param="input",
                           code="invalid_value")
    return checked


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32 bytes, as OpenAI's SDKs decode them
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def response_body(result: Embeddings, name: str, encoding: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(row, encoding)}
                 for i, row in enumerate(result.vectors)],
        "model": name,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


async def create_embeddings(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = validate(EmbeddingsRequest, await read_json(request, ctx.settings.max_body_bytes))
    served = ctx.embeddings.get(body.model)
    if served is None:
        raise APIError(404, f"the embedding model {body.model!r} does not exist on this "
                       f"server; it serves {sorted(ctx.embeddings)}", param="model",
                       code="model_not_found")
    texts = _texts(body.input)
    result = await embedded(request, ctx, served, texts, ENDPOINT)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    if body.dimensions is not None and body.dimensions != result.vectors.shape[1]:
        raise APIError(400, f"dimensions: {served.name} gives {result.vectors.shape[1]} "
                       "dimensions and cannot shorten them", param="dimensions",
                       code="invalid_value")
    ctx.metrics.count(ENDPOINT, "ok")
    return JSONResponse(response_body(result, served.name, body.encoding_format))


async def embedded(request: Request, ctx: ServerContext, served: ServedEmbedding,
                   texts: Sequence[str], endpoint: str) -> Embeddings | None:
    """``texts`` embedded on ``served``: admitted, and cancelled if the client leaves (None,
    counted as ``endpoint``'s disconnect); the engine's refusals as API errors. Every
    embedding door runs this."""
    slot = served.admission.admit()
    try:
        handle = served.engine.embed(texts, served.model)
        try:
            return await unless_disconnected(request, handle.aresult)
        except ClientGone:  # the request owns its embedding: the one place it is cancelled
            handle.cancel()
            raise
    except ClientGone:
        ctx.metrics.count(endpoint, "disconnected")
        return None
    except EngineError as exc:
        raise from_engine(exc, prompt_param="input") from exc
    finally:
        slot.release()
