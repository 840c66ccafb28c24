"""Errors as Ollama's API answers them: ``{"error": "message"}`` with the HTTP status.

The rest of the server raises ``APIError`` (OpenAI's shape, ``{"error": {"message", ...}}``).
Ollama's clients read a bare ``error`` string instead: the ``ollama`` client raises
``ResponseError(error, status_code)`` from a failed response's body, and from an
``{"error": ...}`` line in a stream. ``ollama_route`` wraps each Ollama route so its
``APIError``s (and unexpected failures) are answered in that shape, with the status the
other doors give the same refusal, and counted as the app counts the other endpoints'.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_providers.server.errors import APIError

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


def error_body(message: str) -> dict[str, Any]:
    """Ollama's error object: one string (the ``ollama`` client raises it as it is)."""
    return {"error": message}


def outcome_of(status: int) -> str:
    """The metrics outcome of a refused request, as the app names the other doors'."""
    return "rejected" if status == 429 else "client_error" if status < 500 else "server_error"


def ollama_route(endpoint: str | None = None) -> Callable[[Handler], Handler]:
    """A route answering its errors as Ollama does; ``endpoint``: the metrics label its
    refusals are counted under (None: a route the metrics do not count, /api/tags...)."""
    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                status, message, headers = exc.status, exc.message, exc.headers
            except Exception as exc:  # a bug: said as Ollama says errors, and logged
                log.exception("unexpected error serving %s", request.url.path)
                status, message, headers = 500, f"internal error: {exc!r}", {}
            if endpoint is not None:
                request.app.state.ctx.metrics.count(endpoint, outcome_of(status))
            return JSONResponse(error_body(message), status_code=status, headers=headers)
        return route
    return wrap
