"""Ollama's streaming: newline-delimited JSON, one object a line (``application/x-ndjson``).

``NDJSONResponse`` streams an async iterator of lines and watches the client's connection
itself, whatever ASGI spec version the server speaks: a disconnect cancels the stream's
task, which unwinds the request's ``async with`` (``generation.Rows``, the one owner of a
request's cancel) and evicts its rows. Starlette's ``StreamingResponse`` does
that only under ASGI spec < 2.4; under 2.4 it learns of a disconnect only from a send that
fails, which uvicorn does not raise, and a dropped stream would generate to its end for
nobody. (SSE streams get the same watch from sse-starlette's ``EventSourceResponse``.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

NDJSON = "application/x-ndjson"  # what Ollama sends a stream as


def line(value: Mapping[str, Any]) -> str:
    """One NDJSON line: compact JSON and its newline (a client splits on newlines, and
    JSON text escapes every newline inside a string)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n"


class NDJSONResponse(StreamingResponse):
    """A stream of NDJSON lines, cancelled when its client disconnects."""

    media_type = NDJSON

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()  # sent in full: stop watching

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()  # the client left (or the stream ended): stop it
        if self.background is not None:
            await self.background()
