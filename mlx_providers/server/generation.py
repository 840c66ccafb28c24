"""One generation for an HTTP request, the same for every endpoint that generates.

Both ``/v1/chat/completions`` and ``/v1/responses`` reduce a request to the engine's
``ChatRequest`` and an ``Answer`` (what their wire format makes of engine events), and
``serve`` runs the rest: admission, submit, the first event (so a refused request is a 4xx
before any byte is sent), then the whole answer or its SSE stream, metrics and errors.
``serve_rows`` is the same flow for a request of several rows (the legacy
``/v1/completions``' prompts and ``n``; ``serve`` is its one-row case): every row is
admitted and submitted before any is waited for, so they batch, and a stream sends their
events as they come.

Cancellation has one owner per request: the ``Rows`` (a ``Generation`` each), used as an
async context manager around everything that reads them, cancel every row when that block
exits early (a client gone while waiting, an SSE body closed by a disconnect, an error).
Nothing else in the server cancels a generation, and a handle sends its Cancel to the
engine at most once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Protocol, TypeVar

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

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
    """One submitted row and its events; with its request's other rows (``Rows``, which
    the flow holds), the only owner of its cancellation.

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
        return await unless_disconnected(request, self.read_first)

    async def read_first(self) -> StreamEvent:
        """Wait for the first event (the caller watches the client: ``start``)."""
        self.first = await anext(self._events)
        return self.first

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The first event, then the rest to the final one."""
        assert self.first is not None, "start() first"
        yield self.first
        if self.first.is_final:
            return
        async for event in self._events:
            yield event


class Rows:
    """A request's generations, a row each, in choice order; the only owner of their
    cancellation, as ``Generation`` is of one: leaving ``async with rows:`` by an
    exception cancels every row, and ``cancel`` ends the others when one failed."""

    def __init__(self) -> None:
        self.generations: list[Generation] = []

    async def __aenter__(self) -> Rows:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        if kind is not None:  # left early: nobody will read the rest
            self.cancel()

    def cancel(self) -> None:
        """Cancel every row (a finished row ignores it)."""
        for generation in self.generations:
            generation.handle.cancel()

    async def start(self, request: Request) -> None:
        """Wait for every row's first event (ClientGone if the client leaves first)."""
        async def firsts() -> None:
            for generation in self.generations:
                if generation.first is None:
                    await generation.read_first()

        await unless_disconnected(request, firsts)


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


class RowsAnswer(Protocol):
    """An ``Answer`` of several rows (``serve_rows``): each event comes with its row's index."""

    def start(self) -> list[Any]: ...

    def feed(self, index: int, event: StreamEvent) -> list[Any]: ...

    def fail(self, error: BaseException) -> list[Any]: ...

    def end(self) -> list[Any]: ...

    def body(self) -> dict[str, Any]: ...

    def close(self, outcome: str) -> None: ...


class _OneRow:
    """An ``Answer`` as the ``RowsAnswer`` of its one row."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def start(self) -> list[Any]:
        return self.answer.start()

    def feed(self, index: int, event: StreamEvent) -> list[Any]:
        return self.answer.feed(event)

    def fail(self, error: BaseException) -> list[Any]:
        return self.answer.fail(error)

    def end(self) -> list[Any]:
        return self.answer.end()

    def body(self) -> dict[str, Any]:
        return self.answer.body()

    def close(self, outcome: str) -> None:
        self.answer.close(outcome)


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
    return await serve_rows(request, endpoint, served, [spec], _OneRow(answer), stream=stream,
                            fit_context=fit_context, keep_alive=keep_alive,
                            stream_response=stream_response)


# A row's event, by the row's index in the request.
RowEvent = tuple[int, StreamEvent]


async def serve_rows(request: Request, endpoint: Endpoint, served: ServedModel,
                     specs: Sequence[EngineRequest], answer: RowsAnswer, *, stream: bool,
                     fit_context: bool, keep_alive: float | None = None,
                     stream_response: StreamResponse = EventSourceResponse) -> Response:
    """``serve`` for a request of several rows (``specs``, in the order ``answer`` indexes
    them): each row is admitted as a request is, all or none (a 429 admits none); every
    row is submitted before any is waited for; a row the engine refuses refuses the
    request (the others are cancelled); a stream sends each row's events as they come."""
    slots = _Slots(served, len(specs))
    options = submit_options(keep_alive)
    try:
        rows = await _started(request, served.engine, specs, endpoint, fit_context, options)
    except ClientGone:
        slots.release()
        return _gone(endpoint)
    except BaseException:
        slots.release()
        raise
    if stream:  # from here on the stream's body owns the slots and the rows
        if len(rows.generations) == 1:
            return stream_response(_sse(endpoint, served, rows, _indexed(rows.generations[0]),
                                        answer, slots))
        return _MergedRows(rows, lambda events: stream_response(
            _sse(endpoint, served, rows, events, answer, slots)))
    try:
        async with rows:
            await unless_disconnected(request, lambda: _whole(endpoint, served, rows, answer))
    except ClientGone:
        return _gone(endpoint)
    finally:
        slots.release()
    answer.close("ok")
    endpoint.metrics.count(endpoint.name, "ok")
    return JSONResponse(answer.body())


class _Slots:
    """A request's admission: a slot per row (a request of many prompts queues as that
    many requests would), taken all or none; ``release`` frees them all, once."""

    def __init__(self, served: ServedModel, rows: int) -> None:
        self._slots: list[Slot] = []
        try:
            for _ in range(rows):
                self._slots.append(served.admit())
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for slot in self._slots:
            slot.release()


async def _started(request: Request, engine: Engine, specs: Sequence[EngineRequest],
                   endpoint: Endpoint, fit_context: bool,
                   options: Mapping[str, Any]) -> Rows:
    """Every row submitted, then each one's first event read; engine refusals raised as
    4xx/5xx (leaving ``async with rows`` cancels the rows already submitted)."""
    rows = Rows()
    async with rows:  # a client that leaves while the rows wait cancels them here
        for spec in specs:  # all submitted before any is waited for: they batch
            rows.generations.append(_submitted(engine, spec, endpoint, options))
        await rows.start(request)
        for index, spec in enumerate(specs):
            first = rows.generations[index].first
            error = first.error if first is not None else None
            if (fit_context and isinstance(error, ContextLengthError)
                    and error.prompt_tokens < error.limit):
                fitted = replace(spec, params=replace(
                    spec.params, max_tokens=error.limit - error.prompt_tokens))
                rows.generations[index] = _submitted(engine, fitted, endpoint, options)
        await rows.start(request)  # the refitted rows' first events
        for generation in rows.generations:
            assert generation.first is not None
            if generation.first.error is not None:
                raise endpoint.error(generation.first.error)
    return rows


def _submitted(engine: Engine, spec: EngineRequest, endpoint: Endpoint,
               options: Mapping[str, Any]) -> Generation:
    try:
        return Generation(engine.submit(spec, **options))
    except (ValueError, TypeError, EngineError) as exc:  # bad input, or a dead engine
        raise endpoint.error(exc) from exc


async def _whole(endpoint: Endpoint, served: ServedModel, rows: Rows,
                 answer: RowsAnswer) -> None:
    """Feed every row's events to ``answer``; a failed row raises its HTTP error. The rows
    run together in the engine, whichever is read first."""
    for index, generation in enumerate(rows.generations):
        async for event in generation.events():
            if event.error is not None:
                raise endpoint.error(event.error)
            answer.feed(index, event)
            if event.is_final:
                endpoint.metrics.observe(served.name, event.usage)


async def _indexed(generation: Generation) -> AsyncIterator[RowEvent]:
    """A one-row request's events, as row 0's."""
    async for event in generation.events():
        yield 0, event


class _MergedRows(Response):
    """A stream of several rows: a task forwards each row's events into one channel as they
    come, and the body (``respond``'s response over that channel) reads them in that order.
    The forwarding tasks' group is this response's own, alive exactly while it runs: a
    task group inside the body's generator would be open across its yields, which anyio
    does not allow. A disconnect ends the body; the group then cancels the forwarders."""

    def __init__(self, rows: Rows,
                 respond: Callable[[AsyncIterator[RowEvent]], Response]) -> None:
        self._rows = rows
        self._sender, self._receiver = anyio.create_memory_object_stream[RowEvent]()
        self._inner = respond(self._receiver)
        self.status_code = self._inner.status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._forward)
                await self._inner(scope, receive, send)
                group.cancel_scope.cancel()
        finally:
            self._receiver.close()

    async def _forward(self) -> None:
        """Every row's events into the channel; closed when the last row has ended."""
        async with self._sender, anyio.create_task_group() as group:
            for index, generation in enumerate(self._rows.generations):
                group.start_soon(self._forward_row, index, generation)

    async def _forward_row(self, index: int, generation: Generation) -> None:
        async for event in generation.events():
            await self._sender.send((index, event))


async def _sse(endpoint: Endpoint, served: ServedModel, rows: Rows,
               events: AsyncIterator[RowEvent], answer: RowsAnswer,
               slots: _Slots) -> AsyncIterator[Any]:
    """Stream items; a failure mid-stream sends the endpoint's error items (the other rows
    cancelled), then ends."""
    outcome = "disconnected"  # unless the loop below reaches an end
    try:
        async with rows:
            for item in answer.start():
                yield item
            async for index, event in events:
                if event.error is not None:
                    for item in answer.fail(event.error):
                        yield item
                    outcome = "server_error"
                    rows.cancel()  # the other rows: nobody reads them now
                    return
                for item in answer.feed(index, event):
                    yield item
                if event.is_final:
                    endpoint.metrics.observe(served.name, event.usage)
            for item in answer.end():
                yield item
            outcome = "ok"
    finally:
        answer.close(outcome)
        slots.release()
        endpoint.metrics.count(endpoint.name, outcome)


def _gone(endpoint: Endpoint) -> Response:
    endpoint.metrics.count(endpoint.name, "disconnected")
    return Response(status_code=CLIENT_CLOSED)

