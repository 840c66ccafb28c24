"""Waiters: the one wait that chat streams and embedding requests share (no mlx)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from engine.core.waiters import Waiters


class Box:
    """A state another thread fills: values waited for and taken one at a time."""

    def __init__(self) -> None:
        self.waiters = Waiters()
        self.values: list[int] = []

    def put(self, value: int) -> None:
        with self.waiters.changing():
            self.values.append(value)

    def has(self) -> bool:
        return bool(self.values)

    def take(self) -> int:
        return self.values.pop(0)


def put_later(box: Box, *values: int, delay: float = 0.05) -> threading.Thread:
    def run() -> None:
        for value in values:
            time.sleep(delay)
            box.put(value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_blocked_thread_is_woken_and_takes_under_the_lock() -> None:
    box = Box()
    thread = put_later(box, 1)
    assert box.waiters.wait(box.has, box.take, 5.0, "late") == 1
    thread.join()
    assert box.values == []


def test_the_timeout_raises_with_the_owners_message() -> None:
    box = Box()
    with pytest.raises(TimeoutError, match="nothing came"):
        box.waiters.wait(box.has, box.take, 0.05, "nothing came")


def test_two_consumers_never_take_one_value() -> None:
    box = Box()
    taken: list[int] = []

    def consume() -> None:
        taken.append(box.waiters.wait(box.has, box.take, 5.0, "late"))

    consumers = [threading.Thread(target=consume) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    put_later(box, 1, 2).join()
    for consumer in consumers:
        consumer.join()
    assert sorted(taken) == [1, 2]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_task_is_woken_from_another_thread(backend: str) -> None:
    box = Box()

    async def main() -> list[int]:
        thread = put_later(box, 1, 2)
        got = [await box.waiters.wait_async(box.has, box.take) for _ in range(2)]
        thread.join()
        return got

    assert anyio.run(main, backend=backend) == [1, 2]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancelled_task_stops_waiting_and_a_later_change_wakes_nobody(backend: str) -> None:
    box = Box()

    async def main() -> None:
        with anyio.move_on_after(0.05):
            await box.waiters.wait_async(box.has, box.take)

    anyio.run(main, backend=backend)
    box.put(1)  # the cancelled task's wake-up is called on a finished loop: no error
    assert box.values == [1]
