"""The hand-off between the engine thread and a request's consumer (no mlx).

The engine thread only appends events and wakes waiters without blocking
(``engine.core.waiters``: sync consumers on a condition variable, asyncio and trio
consumers through their own loop's thread-safe call).
Leaving early (break, closing, task cancellation, garbage collection) cancels.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from engine.core.waiters import Waiters, is_cancellation
from engine.requests.outbound.results import Completion, StreamEvent


class RequestStream:
    """Events of one request, produced on the engine thread, consumed anywhere."""

    def __init__(self) -> None:
        self._waiters = Waiters()
        self._events: deque[StreamEvent] = deque()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def publish(self, event: StreamEvent, completion: Completion | None = None) -> None:
        """Append an event (engine thread). A final event must come with its completion."""
        with self._waiters.changing():
            if self._finished:
                return
            self._events.append(event)
            if event.is_final:
                self._completion = completion
                self._error = event.error
                self._finished = True

    def next_event(self, timeout: float | None = None) -> StreamEvent | None:
        """Block until an event is available; None when the stream is exhausted."""
        return self._waiters.wait(self._has_news, self._take_event, timeout,
                                  "no event within the wait timeout")

    async def anext_event(self) -> StreamEvent | None:
        """Await the next event without blocking the event loop."""
        return await self._waiters.wait_async(self._has_news, self._take_event)

    def wait_completion(self, timeout: float | None = None) -> Completion:
        return self._waiters.wait(self._is_finished, self._final, timeout,
                                  "the request did not finish within the wait timeout")

    async def await_completion(self) -> Completion:
        return await self._waiters.wait_async(self._is_finished, self._final)

    def _has_news(self) -> bool:
        return bool(self._events) or self._finished

    def _is_finished(self) -> bool:
        return self._finished

    def _take_event(self) -> StreamEvent | None:
        return self._events.popleft() if self._events else None

    def _final(self) -> Completion:
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion


class RequestHandle:
    """A submitted request: iterate (sync or async) for events, or wait for the result.

    Breaking out of a loop over it, closing the iterator, cancelling the task that
    awaits it, or calling ``cancel()`` evicts the request's row from the batch.
    The last event has ``finish_reason``; for a failed or timed-out request the
    iteration then raises the error, in this consumer only.
    """

    def __init__(self, request_id: int, stream: RequestStream, cancel: Callable[[], None]):
        self.request_id = request_id
        self._stream = stream
        self._cancel = cancel
        # Every way of leaving (close, task cancel, GC, cancel()) lands here: send once.
        self._cancel_sent = threading.Lock()

    @property
    def done(self) -> bool:
        return self._stream.finished

    def cancel(self) -> None:
        """Evict this request at the next step boundary (no-op once finished or sent)."""
        if not self._stream.finished and self._cancel_sent.acquire(blocking=False):
            self._cancel()

    def __iter__(self) -> Iterator[StreamEvent]:
        return _SyncEvents(self)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return _AsyncEvents(self)

    def result(self, timeout: float | None = None) -> Completion:
        """Block until finished; raise the request's error if it failed or timed out."""
        return self._stream.wait_completion(timeout)

    async def aresult(self) -> Completion:
        """Await the completion; cancelling the awaiting task cancels the request."""
        try:
            return await self._stream.await_completion()
        except BaseException as exc:
            if is_cancellation(exc):
                self.cancel()
            raise


def _raise_if_failed(event: StreamEvent) -> None:
    # Failures and timeouts carry an error; a plain cancel ends quietly.
    if event.error is not None:
        raise event.error


class _SyncEvents(Iterator[StreamEvent]):
    """Iterator that cancels the request if closed or dropped before the end."""

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._last: StreamEvent | None = None

    def __next__(self) -> StreamEvent:
        if self._last is not None and self._last.is_final:
            _raise_if_failed(self._last)
            raise StopIteration
        event = self._handle._stream.next_event()
        if event is None:
            raise StopIteration
        self._last = event
        return event

    def close(self) -> None:
        self._handle.cancel()

    def __del__(self) -> None:
        self._handle.cancel()


class _AsyncEvents(AsyncIterator[StreamEvent]):
    """Async iterator; task cancellation, aclose() or dropping it cancels the request."""

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._last: StreamEvent | None = None

    async def __anext__(self) -> StreamEvent:
        if self._last is not None and self._last.is_final:
            _raise_if_failed(self._last)
            raise StopAsyncIteration
        try:
            event = await self._handle._stream.anext_event()
        except BaseException as exc:
            if is_cancellation(exc):
                self._handle.cancel()
            raise
        if event is None:
            raise StopAsyncIteration
        self._last = event
        return event

    async def aclose(self) -> None:
        self._handle.cancel()

    def __del__(self) -> None:
        self._handle.cancel()
