"""One engine per model per process, from any thread or event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine import TextRequest, get_engine
from engine.registry import close_all


@pytest.fixture(autouse=True)
def _fresh_registry() -> None:
    close_all()
    yield
    close_all()


def test_same_model_same_engine_from_threads_and_loops(tiny_model_dir: Path) -> None:
    found: list[object] = []

    def grab() -> None:
        found.append(get_engine(tiny_model_dir))

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    async def from_loop() -> object:
        return get_engine(str(tiny_model_dir) + "/")

    found.append(asyncio.run(from_loop()))
    assert len({id(e) for e in found}) == 1


def test_conflicting_config_raises_instead_of_a_second_copy(tiny_model_dir: Path) -> None:
    first = get_engine(tiny_model_dir, max_batch=8)
    assert get_engine(tiny_model_dir) is first
    assert get_engine(tiny_model_dir, max_batch=8) is first
    with pytest.raises(ValueError, match="max_batch"):
        get_engine(tiny_model_dir, max_batch=4)


def test_a_closed_engine_is_replaced(tiny_model_dir: Path) -> None:
    first = get_engine(tiny_model_dir)
    first.close()
    second = get_engine(tiny_model_dir)
    assert second is not first
    assert second.submit(TextRequest("hi")).result().usage.completion_tokens > 0
