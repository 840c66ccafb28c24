"""Unit tests run without a model: none of them may import mlx or mlx-lm."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


def _mlx_loaded() -> set[str]:
    return {m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm")}


@pytest.fixture(autouse=True)
def _no_mlx_in_unit_tests() -> Iterator[None]:
    # Checked only while mlx is not loaded yet (in a full run, engine tests may load it).
    before = _mlx_loaded()
    yield
    if not before:
        loaded = _mlx_loaded()
        assert not loaded, f"a unit test imported {sorted(loaded)[:3]}: move it to tests/engine"
