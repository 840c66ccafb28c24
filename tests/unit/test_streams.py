"""Streams: the engine-thread -> consumer hand-off, with no model (no mlx)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import anyio
import pytest

from engine.core.streams import RequestHandle, RequestStream
from engine.errors import RequestTimeoutError
from engine.requests.outbound.results import Completion, FinishReason, StreamEvent, Usage


def make_handle() -> tuple[RequestHandle, RequestStream, list[int]]:
    stream = RequestStream()
    cancels: list[int] = []
    return RequestHandle(7, stream, lambda: cancels.append(7)), stream, cancels


def finish(stream: RequestStream, reason: FinishReason = FinishReason.STOP,
           error: BaseException | None = None, text: str = "ab") -> None:
    usage = Usage(3, 2)
    stream.publish(StreamEvent("b", (2,), None, reason, usage, error),
                   Completion(text, (1, 2), reason, usage))


def produce_later(stream: RequestStream, delay: float = 0.05, **kw: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        stream.publish(StreamEvent("a", (1,)))
        time.sleep(delay)
        finish(stream, **kw)  # type: ignore[arg-type]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sync_iteration_from_another_thread() -> None:
    handle, stream, cancels = make_handle()
    thread = produce_later(stream)
    events = list(handle)
    thread.join()
    assert [e.text for e in events] == ["a", "b"]
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].usage == Usage(3, 2)
    assert handle.result().text == "ab"
    assert cancels == []  # finished streams are not cancelled when iterators are dropped


def test_break_out_of_sync_loop_cancels() -> None:
    handle, stream, cancels = make_handle()
    stream.publish(StreamEvent("a", (1,)))
    for _ in handle:
        break
    gc.collect()
    assert cancels == [7]


def test_closing_sync_iterator_cancels() -> None:
    handle, _, cancels = make_handle()
    iterator = iter(handle)
    iterator.close()  # type: ignore[attr-defined]
    assert cancels


async def test_asyncio_consumer_is_woken_from_a_thread() -> None:
    handle, stream, _ = make_handle()
    thread = produce_later(stream)
    texts = [e.text async for e in handle]
    thread.join()
    assert texts == ["a", "b"]
    assert (await handle.aresult()).text == "ab"


async def test_cancelling_the_awaiting_task_cancels_the_request() -> None:
    handle, _, cancels = make_handle()

    async def consume() -> None:
        async for _ in handle:
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancels == [7]
    handle2, _, cancels2 = make_handle()
    task2 = asyncio.create_task(handle2.aresult())
    await asyncio.sleep(0.02)
    task2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task2
    assert cancels2 == [7]


def test_trio_consumer_via_anyio() -> None:
    pytest.importorskip("trio", reason="trio is not installed")
    handle, stream, _ = make_handle()

    async def main() -> list[str]:
        thread = produce_later(stream)
        texts = [e.text async for e in handle]
        await anyio.to_thread.run_sync(thread.join)
        return texts

    assert anyio.run(main, backend="trio") == ["a", "b"]


def test_trio_cancel_scope_cancels_the_request() -> None:
    pytest.importorskip("trio", reason="trio is not installed")
    handle, _, cancels = make_handle()

    async def main() -> None:
        with anyio.move_on_after(0.05):
            await handle.aresult()

    anyio.run(main, backend="trio")
    assert cancels == [7]


def test_failure_is_raised_after_the_final_event() -> None:
    handle, stream, _ = make_handle()
    finish(stream, FinishReason.ERROR, error=KeyError("boom"))
    seen = []
    with pytest.raises(KeyError):
        for event in handle:
            seen.append(event.finish_reason)
    assert seen == [FinishReason.ERROR]
    with pytest.raises(KeyError):
        handle.result()


def test_timeout_raises_but_plain_cancel_returns() -> None:
    handle, stream, _ = make_handle()
    finish(stream, FinishReason.CANCELLED, error=RequestTimeoutError("late"))
    with pytest.raises(TimeoutError):
        handle.result()
    handle2, stream2, _ = make_handle()
    finish(stream2, FinishReason.CANCELLED)
    assert handle2.result().finish_reason is FinishReason.CANCELLED
    assert [e.finish_reason for e in handle2] == [FinishReason.CANCELLED]


def test_publishing_never_blocks_on_a_slow_consumer() -> None:
    handle, stream, _ = make_handle()
    start = time.perf_counter()
    for i in range(10_000):
        stream.publish(StreamEvent(str(i), (i,)))
    finish(stream)
    assert time.perf_counter() - start < 5  # generous: only proves no per-event wait
    assert len(list(handle)) == 10_001


def test_events_after_the_final_one_are_ignored() -> None:
    handle, stream, _ = make_handle()
    finish(stream)
    stream.publish(StreamEvent("late", (9,)))
    assert [e.text for e in handle] == ["b"]
