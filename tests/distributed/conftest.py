"""Fixtures the two-rank tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import _built, _cache_root


@pytest.fixture(scope="session")
def shardable_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 with 4 heads, 2 KV heads and 4 layers: splits over two ranks."""
    return _built(_cache_root(tmp_path_factory) / "tiny-qwen2-shardable-v1",
                  heads=4, kv_heads=2, layers=4)  # type: ignore[arg-type]
