"""Waiting on a state the engine thread changes, from any thread or event loop (no mlx).

The one hand-off both chat streams and embedding requests use. The owner of the state
changes it inside ``Waiters.changing()``, which holds the lock and then wakes everyone:
threads blocked on the condition at once, async tasks (asyncio or trio, found by sniffio,
as anyio runs them) through a call their own loop makes. The engine thread never waits on
a consumer: waking is a notify and one thread-safe call per waiting task. A consumer
waits until its condition holds, then takes its value under the same lock, so two
consumers never both take one event.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import sniffio

T = TypeVar("T")


class Waiters:
    """Threads and tasks waiting on one state, and the lock that guards it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._blocked = 0  # threads in wait(): notify the condition only when there are some
        self._wakers: list[Callable[[], None]] = []  # one per task in wait_async()

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the lock while the state changes, then wake every waiter (each rechecks its
        condition, so a block that changed nothing wakes nobody for long). Tasks are woken
        after the lock is released: their loops' calls never run under it."""
        with self._lock:
            yield
            wakers, self._wakers = self._wakers, []
            if self._blocked:
                self._ready.notify_all()
        for wake in wakers:
            wake()

    def wait(self, ready: Callable[[], bool], take: Callable[[], T],
             timeout: float | None, timed_out: str) -> T:
        """Block this thread until ``ready()``, then return ``take()``, both under the lock;
        ``TimeoutError(timed_out)`` when ``timeout`` seconds pass first."""
        with self._lock:
            if not ready():
                self._blocked += 1
                try:
                    if not self._ready.wait_for(ready, timeout):
                        raise TimeoutError(timed_out)
                finally:
                    self._blocked -= 1
            return take()

    async def wait_async(self, ready: Callable[[], bool], take: Callable[[], T]) -> T:
        """Await ``ready()`` without blocking the loop, then return ``take()`` (both under
        the lock). Cancelling the awaiting task raises here; the caller decides what that
        cancels (``is_cancellation``)."""
        while True:
            with self._lock:
                if ready():
                    return take()
                wait, wake = _loop_wait()
                self._wakers.append(wake)
            await wait()


def _loop_wait() -> tuple[Callable[[], Awaitable[object]], Callable[[], None]]:
    """An awaitable wait on the running loop (asyncio or trio) and the call, safe from any
    thread, that ends it."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio_event = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake_trio() -> None:
            try:
                token.run_sync_soon(trio_event.set)
            except trio.RunFinishedError:  # the consumer's run is over: nobody is waiting
                pass

        return trio_event.wait, wake_trio
    loop = asyncio.get_running_loop()
    asyncio_event = asyncio.Event()

    def wake_asyncio() -> None:
        try:
            loop.call_soon_threadsafe(asyncio_event.set)
        except RuntimeError:  # the consumer's loop is closed: nobody is waiting
            pass

    return asyncio_event.wait, wake_asyncio


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` ends a wait because its consumer left: a cancelled asyncio task, a
    trio cancel scope, or a generator closed."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return True
    return type(exc).__name__ == "Cancelled" and type(exc).__module__.startswith("trio")
