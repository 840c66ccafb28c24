"""Errors in Anthropic's envelope, for the Messages door (``/v1/messages``).

Anthropic's API answers ``{"type": "error", "error": {"type": ..., "message": ...}}`` and
its SDKs pick their exception classes by status code (``anthropic.BadRequestError`` for
400, ``OverloadedError`` for 529, ...). The server's shared code (body parsing, model
routing, admission, the generation flow) raises the OpenAI-shaped ``APIError``; the
Messages door converts each one here, once, so every refusal the other doors give reaches
an Anthropic client in the shape its SDK reads, with the same message.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_providers.server.errors import APIError, from_engine

log = logging.getLogger(__name__)

# Every path of the door starts with this (``/v1/messages``, ``/v1/messages/count_tokens``):
# the API-key check answers these in Anthropic's envelope too.
PATH_PREFIX = "/v1/messages"
OVERLOADED = 529  # Anthropic's "the API is overloaded": the server sheds load (its 429)
# Anthropic's error type for each status it uses; another status keeps its code and is
# typed ``api_error`` (a 503 while the model is unavailable: the SDK retries 5xx).
TYPES = {400: "invalid_request_error", 401: "authentication_error",
         403: "permission_error", 404: "not_found_error", 413: "request_too_large",
         429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
         OVERLOADED: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether a request path is the Messages door's (its errors are Anthropic's)."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


class AnthropicError(APIError):
    """An ``APIError`` whose body is Anthropic's envelope (the app's handler sends it)."""

    def body(self) -> dict[str, Any]:
        return envelope(self.type, self.message)


def envelope(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic(error: APIError) -> AnthropicError:
    """The server's error as the Messages door answers it: the same message (naming its
    parameter) and headers (``Retry-After``); a 429 (the model's queue is full) becomes 529
    ``overloaded_error``, which is what Anthropic's API answers when it sheds load and what
    its SDKs retry."""
    if isinstance(error, AnthropicError):
        return error
    status = OVERLOADED if error.status == 429 else error.status
    # Anthropic's envelope has no ``param``: the message names the field instead.
    message = error.message if not error.param or error.param in error.message else (
        f"{error.param}: {error.message}")
    return AnthropicError(status, message, type=TYPES.get(status, "api_error"),
                          param=error.param, code=error.code, headers=error.headers)


def engine_error(exc: BaseException, **params: Any) -> AnthropicError:
    """An engine error (a refusal, a dead engine) as this door answers it."""
    return as_anthropic(from_engine(exc, **params))


Handler = Callable[[Request], Awaitable[Response]]


def anthropic_errors(handler: Handler) -> Handler:
    """Wrap an endpoint so whatever it raises reaches the client in Anthropic's envelope:
    the server's ``APIError``s converted, anything unexpected a logged 500 ``api_error``
    (the app's own handler would answer OpenAI's shape)."""
    @wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            raise as_anthropic(exc) from exc
        except Exception as exc:
            # The app's handler for anything else answers OpenAI's shape: log it as that
            # handler does, and answer this door's.
            log.exception("unexpected error serving %s", request.url.path, exc_info=exc)
            raise AnthropicError(500, f"internal error: {exc!r}", type="api_error") from exc
    return wrapped


async def not_found(request: Request) -> Response:
    """Any other path under ``/v1/messages`` (batches, a message by id): not served."""
    return JSONResponse(envelope("not_found_error", f"{request.url.path} is not served here: "
                                 "this server serves POST /v1/messages and "
                                 "/v1/messages/count_tokens"), status_code=404)
