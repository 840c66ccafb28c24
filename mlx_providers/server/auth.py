"""API-key authentication: every path but ``/health`` needs the server's API key, sent as
``Authorization: Bearer <key>`` (OpenAI's SDKs) or ``x-api-key: <key>`` (Anthropic's)."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_providers.server.anthropic_errors import envelope, is_anthropic_path

OPEN_PATHS = frozenset({"/health"})


class BearerAuth:
    """ASGI middleware comparing ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # compare_digest: the time taken does not depend on how much of the key matched;
        # both headers are compared every time (``|``, not ``or``).
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self._expected)
        if bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), self._key):
            await self.app(scope, receive, send)
            return
        message = ("missing or incorrect API key: send 'Authorization: Bearer <key>' or "
                   "'x-api-key: <key>'")
        body = json.dumps(envelope("authentication_error", message) if is_anthropic_path(
            scope["path"]) else {"error": {"message": message, "type": "invalid_request_error",
                                           "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
