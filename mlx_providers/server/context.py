"""What every endpoint shares: settings, served models, metrics, the store, body parsing."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from engine import MEDIA_PARTS
from mlx_providers.server.errors import APIError, from_validation
from mlx_providers.server.metrics import ServerMetrics
from mlx_providers.server.responses_store import ResponseStore
from mlx_providers.server.served import ServedEmbedding, ServedModel, ServedModels

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    """Server-side limits and defaults (the engine's own live in ``EngineConfig``)."""

    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 512
    default_temperature: float = 0.0  # greedy unless asked: rows then share one sampler
    max_queue: int = 64  # requests per model beyond max_batch (or embed_max_batch) before 429
    store_ttl_seconds: float | None = 3600.0
    store_max_bytes: int = 64 << 20
    # LoRA adapters by name (``--adapter name=path``): a request names one as its model's
    # suffix (``base:name``) or in its ``adapter`` field. Only these are served.
    adapters: Mapping[str, str] = field(default_factory=dict)
    # ``--allow-adapter-paths``: the ``adapter`` field may also name a server directory to
    # load. Off by default: a remote client could load (and probe) any local path.
    allow_adapter_paths: bool = False


@dataclass(frozen=True)
class ServerContext:
    settings: ServerSettings
    models: ServedModels
    metrics: ServerMetrics
    store: ResponseStore
    embeddings: Mapping[str, ServedEmbedding] = field(default_factory=dict)  # by name


def route_model(ctx: ServerContext, model: str, adapter: str | None,
                ) -> tuple[ServedModel, str | None]:
    """The served model a request names and the adapter directory it asks for.

    An adapter is a registered name, given as the model's suffix (``base:name``) or in the
    ``adapter`` field; the field may name a directory only with ``allow_adapter_paths``.
    Refusals list the registered names and nothing about the server's files.
    """
    registered = ctx.settings.adapters
    base, sep, suffix = model.rpartition(":")
    if sep and not ctx.models.serves(model) and ctx.models.serves(base):
        if suffix not in registered:
            raise APIError(404, f"the model {model!r} does not exist on this server: "
                           f"{suffix!r} is not a registered adapter; registered: "
                           f"{sorted(registered)}", param="model", code="model_not_found")
        if adapter is not None and adapter != suffix:
            raise APIError(400, f"the model {model!r} names adapter {suffix!r} and the "
                           f"request's adapter field {adapter!r}: give one", param="adapter",
                           code="invalid_value")
        return ctx.models.get(base), registered[suffix]
    served = ctx.models.get(model)
    if adapter is None:
        return served, None
    if adapter in registered:
        return served, registered[adapter]
    if ctx.settings.allow_adapter_paths:
        return served, adapter
    # The value is not echoed: it may be a path, and whether it exists is nobody's business.
    raise APIError(400, "adapter: not a registered adapter; registered: "
                   f"{sorted(registered)}", param="adapter", code="invalid_value")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes`` (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return value


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_bytes} bytes",
                    code="request_too_large")


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from exc


R = TypeVar("R")


def has_images(items: Sequence[Any]) -> bool:
    """Whether chat messages or Responses items carry an image part (decoding one is
    work for a worker thread, not the event loop)."""
    for item in items:
        if not isinstance(item, Mapping):
            continue
        for key in ("content", "output"):
            parts = item.get(key)
            if isinstance(parts, list) and any(
                    isinstance(p, Mapping) and p.get("type") in MEDIA_PARTS for p in parts):
                return True
    return False


async def off_loop(threaded: bool, convert: Callable[[], R]) -> R:
    """``convert()``, on a worker thread when ``threaded`` (images are decoded there, so a
    large screenshot does not stall the other connections), else right here."""
    if not threaded:
        return convert()
    return await anyio.to_thread.run_sync(convert)
