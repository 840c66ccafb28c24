"""One generation on the engine for an HTTP request: submit, race the client, stream.

Both endpoints reduce a request to a ``GenerationSpec`` and run it here. A client that
goes away cancels its row: while the request waits for its first event or its whole
result, a watcher reads the connection's ``http.disconnect`` and cancels the handle (a
queued request is then dropped before prefill, a running row evicted at the next step).
Streams are cancelled by whoever closes them (sse-starlette cancels the body iterator on
disconnect; every iterator here closes the handle in ``finally``).
"""

from __future__ import annotations

import contextlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import anyio
from starlette.requests import Request

from engine import (
    Completion,
    ContextLengthError,
    Engine,
    EngineError,
    Message,
    RequestHandle,
    SamplingParams,
    StreamEvent,
)

T = TypeVar("T")


@dataclass(frozen=True)
class GenerationSpec:
    """What ``Engine.submit`` gets for one HTTP request."""

    messages: Sequence[Message]  # converted once by the engine's rulebook
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def submit(self, engine: Engine) -> RequestHandle:
        """Queue it (raises at once for invalid tools, choices or constraints)."""
        return engine.submit(self.messages, self.params, tools=self.tools,
                             tool_choice=self.tool_choice,
                             parallel_tool_calls=self.parallel_tool_calls,
                             chat_template_kwargs=dict(self.chat_template_kwargs) or None)


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its request was cancelled."""


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends
    # nothing else on a request's receive channel until then).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Cancellable(Protocol):
    """What a client's disconnect cancels: a generation's or an embedding's handle."""

    def cancel(self) -> None: ...


async def unless_disconnected(request: Request, handle: Cancellable,
                              work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``; if the client disconnects first, cancel ``handle``, raise ClientGone."""
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
        handle.cancel()
        raise ClientGone
    return result[0]


class EventStream:
    """A handle's events with the first one already received (so its errors can be 4xx).

    ``events()`` yields the first event, then the rest; leaving early cancels the row.
    """

    def __init__(self, handle: RequestHandle, first: StreamEvent,
                 rest: AsyncIterator[StreamEvent]) -> None:
        self.handle = handle
        self.first = first
        self._rest = rest

    @classmethod
    async def open(cls, request: Request, handle: RequestHandle) -> EventStream:
        """Wait for the first event; ClientGone (and the row cancelled) if the client left."""
        events = aiter(handle)

        async def first() -> StreamEvent:
            return await anext(events)

        try:
            return cls(handle, await unless_disconnected(request, handle, first), events)
        except BaseException:
            handle.cancel()
            raise

    async def completion(self) -> Completion:
        """Read to the end: the completion, or the request's error raised."""
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if event.is_final:
                    if event.error is not None:
                        raise event.error
                    if event.completion is not None:
                        return event.completion
        raise EngineError("the request's stream ended without a completion")

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        try:
            yield self.first
            if self.first.is_final:
                return
            async for event in self._rest:
                yield event
        finally:  # a closed, cancelled or abandoned stream evicts the row
            self.handle.cancel()


async def open_stream(request: Request, engine: Engine, spec: GenerationSpec, *,
                      fit_context: bool) -> EventStream:
    """Submit ``spec`` and wait for its first event (raises at once for invalid input).

    ``fit_context``: the client set no token limit, as OpenAI's clients usually do, so the
    server's default applies; a prompt that fits the context but not with that default is
    resubmitted with the room the context has left (OpenAI's own behaviour when no limit
    is set), instead of failing with an error about a limit the client never chose.
    """
    stream = await EventStream.open(request, spec.submit(engine))
    error = stream.first.error
    if fit_context and isinstance(error, ContextLengthError) and error.prompt_tokens < error.limit:
        fitted = replace(spec, params=replace(spec.params,
                                              max_tokens=error.limit - error.prompt_tokens))
        stream = await EventStream.open(request, fitted.submit(engine))
    return stream
