"""One generation for an HTTP request, the same for every endpoint that generates.

Both ``/v1/chat/completions`` and ``/v1/responses`` reduce a request to the engine's
``ChatRequest`` and an ``Answer`` (what their wire format makes of engine events), and
``serve`` runs the rest: admission, submit, the first event (so a refused request is a 4xx
before any byte is sent), then the whole answer or its SSE stream, metrics and errors.

Cancellation has one owner per request: the ``Generation``, used as an async context
manager around everything that reads it, cancels its row when that block exits early (a
client gone while waiting, an SSE body closed by a disconnect, an error). Nothing else in
the server cancels a generation, and a handle sends its Cancel to the engine at most once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Protocol, TypeVar

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import (
    ContextLengthError,
    Engine,
    EngineError,
    RequestHandle,
    StreamEvent,
)
from engine import Request as EngineRequest  # a ChatRequest or a TextRequest
from mlx_providers._keep_alive import submit_options
from mlx_providers.server.errors import APIError, from_engine
from mlx_providers.server.metrics import ServerMetrics
from mlx_providers.server.served import ServedModel, Slot

T = TypeVar("T")
# Frames a stream's items as the response: SSE (the default) or Ollama's NDJSON.
StreamResponse = Callable[[AsyncIterator[Any]], Response]
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by anyone


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends
    # nothing else on a request's receive channel until then).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``, or raise ClientGone if the client disconnects first.

    ``work`` is cancelled then; cancelling what it waited on is its owner's job.
    """
    result: list[T] = []
    failure: list[Exception] = []
    gone = False
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            nonlocal gone
            await _disconnected(request)
            gone = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # raised below, not wrapped in the group's ExceptionGroup
            failure.append(exc)
        finally:
            group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if gone or not result:
        raise ClientGone
    return result[0]


class Generation:
    """One submitted request and its events; the only owner of its cancellation.

    ``async with generation:`` around whatever reads it: leaving the block by an exception
    (the client gone, an SSE body closed by a disconnect, an error) cancels the row. A row
    that finished ignores it, and a handle sends its Cancel once however often it is asked.
    """

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self._events = aiter(handle)
        self.first: StreamEvent | None = None

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        if kind is not None:  # left early: nobody will read the rest
            self.handle.cancel()

    async def start(self, request: Request) -> StreamEvent:
        """Wait for the first event (ClientGone if the client leaves first)."""
        async def first() -> StreamEvent:
            return await anext(self._events)

        self.first = await unless_disconnected(request, first)
        return self.first

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The first event, then the rest to the final one."""
        assert self.first is not None, "start() first"
        yield self.first
        if self.first.is_final:
            return
        async for event in self._events:
            yield event


class Answer(Protocol):
    """What one endpoint's wire format makes of a generation's engine events."""

    def start(self) -> list[Any]:
        """SSE items sent before the first event."""

    def feed(self, event: StreamEvent) -> list[Any]:
        """The SSE items one engine event becomes (the whole answer is built alongside)."""

    def fail(self, error: BaseException) -> list[Any]:
        """The SSE items that end a stream whose generation failed."""

    def end(self) -> list[Any]:
        """SSE items after the final event (chat completions' ``[DONE]``)."""

    def body(self) -> dict[str, Any]:
        """The whole (non-streaming) answer once every event was fed."""

    def close(self, outcome: str) -> None:
        """The request is over (``ok``, ``disconnected``, ``server_error``): store, tidy up."""


@dataclass(frozen=True)
class Endpoint:
    """Where one generating endpoint counts and how its errors name its parameters."""

    name: str  # the metrics label
    metrics: ServerMetrics
    error_params: Mapping[str, str]  # ``from_engine`` keywords: which parameter to blame
    # How this endpoint's request spells a chat-message field the rulebook names (the
    # Responses API's ``input[i].content[k]``); None: as chat completions do.
    fields: Callable[[str], str] | None = None

    def error(self, exc: BaseException) -> APIError:
        """An engine error as this endpoint's client is answered."""
        return from_engine(exc, fields=self.fields, **self.error_params)


async def serve(request: Request, endpoint: Endpoint, served: ServedModel,
                spec: EngineRequest, answer: Answer, *, stream: bool,
                fit_context: bool, keep_alive: float | None = None,
                stream_response: StreamResponse = EventSourceResponse) -> Response:
    """Run ``spec`` on ``served`` and answer: JSON, or a stream of ``answer``'s items.

    ``spec`` is a ``ChatRequest`` or, for a door that continues raw text (Ollama's
    ``/api/generate`` with ``raw`` or ``suffix``), a ``TextRequest``. ``stream_response``
    frames the streamed items: SSE by default, Ollama's door passes its NDJSON response.

    ``fit_context``: the client set no token limit, so the server's default applies; a
    prompt that fits the context but not with that default is resubmitted with the room
    the context has left (OpenAI's behaviour when no limit is set), instead of failing
    with an error about a limit the client never chose. ``keep_alive``: the request's, in
    seconds (negative: forever; None: not sent, the engine's own applies).
    """
    slot = served.admit()
    options = submit_options(keep_alive)
    try:
        generation = await _started(request, served.engine, spec, endpoint, fit_context,
                                    options)
    except ClientGone:
        slot.release()
        return _gone(endpoint)
    except BaseException:
        slot.release()
        raise
    if stream:  # from here on the stream's body owns the slot and the generation
        return stream_response(_sse(endpoint, served, generation, answer, slot))
    try:
        async with generation:
            await unless_disconnected(request, lambda: _whole(endpoint, served, generation,
                                                              answer))
    except ClientGone:
        return _gone(endpoint)
    finally:
        slot.release()
    answer.close("ok")
    endpoint.metrics.count(endpoint.name, "ok")
    return JSONResponse(answer.body())


async def _started(request: Request, engine: Engine, spec: EngineRequest,
                   endpoint: Endpoint, fit_context: bool,
                   options: Mapping[str, Any]) -> Generation:
    """Submitted, with its first event read; engine refusals raised as 4xx/5xx."""
    generation = await _submitted(request, engine, spec, endpoint, options)
    error = generation.first.error if generation.first is not None else None
    if fit_context and isinstance(error, ContextLengthError) and error.prompt_tokens < error.limit:
        fitted = replace(spec, params=replace(spec.params,
                                              max_tokens=error.limit - error.prompt_tokens))
        generation = await _submitted(request, engine, fitted, endpoint, options)
    assert generation.first is not None
    if generation.first.error is not None:
        raise endpoint.error(generation.first.error)
    return generation


async def _submitted(request: Request, engine: Engine, spec: EngineRequest,
                     endpoint: Endpoint, options: Mapping[str, Any]) -> Generation:
    try:
        generation = Generation(engine.submit(spec, **options))
    except (ValueError, TypeError, EngineError) as exc:  # bad input, or a dead engine
        raise endpoint.error(exc) from exc
    async with generation:  # a client that leaves while the row waits cancels it here
        await generation.start(request)
    return generation


async def _whole(endpoint: Endpoint, served: ServedModel, generation: Generation,
                 answer: Answer) -> None:
    """Feed every event to ``answer``; a failed generation raises its HTTP error."""
    async for event in generation.events():
        if event.error is not None:
            raise endpoint.error(event.error)
        answer.feed(event)
        if event.is_final:
            endpoint.metrics.observe(served.name, event.usage)


async def _sse(endpoint: Endpoint, served: ServedModel, generation: Generation,
               answer: Answer, slot: Slot) -> AsyncIterator[Any]:
    """SSE items; a failure mid-stream sends the endpoint's error items, then ends."""
    outcome = "disconnected"  # unless the loop below reaches an end
    try:
        async with generation:
            for item in answer.start():
                yield item
            async for event in generation.events():
                if event.error is not None:
                    for item in answer.fail(event.error):
                        yield item
                    outcome = "server_error"
                    return
                for item in answer.feed(event):
                    yield item
                if event.is_final:
                    endpoint.metrics.observe(served.name, event.usage)
            for item in answer.end():
                yield item
            outcome = "ok"
    finally:
        answer.close(outcome)
        slot.release()
        endpoint.metrics.count(endpoint.name, outcome)


def _gone(endpoint: Endpoint) -> Response:
    endpoint.metrics.count(endpoint.name, "disconnected")
    return Response(status_code=CLIENT_CLOSED)

