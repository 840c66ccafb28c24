"""KeepAlive's clock and a request's keep_alive, with no model (engine.core.keep_alive)."""

from __future__ import annotations

import math

import pytest

from engine.core.keep_alive import KeepAlive, check_keep_alive


def test_the_clock_starts_at_the_last_use() -> None:
    keep = KeepAlive(30.0)
    assert keep.unload_at() is None and not keep.due(1e9)  # never used: nothing to unload
    keep.used(100.0)
    assert keep.unload_at() == 130.0
    assert not keep.due(129.9) and keep.due(130.0)
    keep.used(125.0)  # a turn ran rows: the clock starts again
    assert not keep.due(130.0) and keep.due(155.0)


def test_the_latest_request_decides() -> None:
    keep = KeepAlive(None)
    keep.used(10.0)
    assert keep.unload_at() is None  # None: kept until close()
    keep.ask(0.0)
    assert keep.due(10.0)  # 0: as soon as the engine is idle
    keep.ask(None)
    assert not keep.due(1e9)
    assert keep.configured is None


def test_a_request_keep_alive_is_checked() -> None:
    assert check_keep_alive(None) is None
    assert check_keep_alive(5) == 5.0 and check_keep_alive(0.5) == 0.5
    for bad in (-1, -0.001, math.inf, math.nan):
        with pytest.raises(ValueError, match="keep_alive must be a finite number"):
            check_keep_alive(bad)
    for wrong in (True, "5m", [5]):
        with pytest.raises(TypeError, match="keep_alive must be seconds"):
            check_keep_alive(wrong)
