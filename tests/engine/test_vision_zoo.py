"""The vision zoo (``testkit.vision_zoo``): every vision family users load, built tiny from
its own config, does in the engine what the declared table
(``engine.requests.inbound.vision_families``) says: its images served exactly (batched ==
alone == mlx-vlm's own generation, text rows beside them unchanged), its text served and
each image refused by name with the table's reason, or its load refused naming it.

``make test`` runs one checkpoint per family; the other variants run in
``make test-fitted``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from engine.requests.inbound.vision_families import FAMILIES, Support, family_of
from testkit.vision_zoo import ZOO, ZooEntry, observe
from tests.conftest import _built, _cache_root, _vision_stack

pytestmark = pytest.mark.timeout(600)


def _param(entry: ZooEntry) -> object:
    marks = () if entry.first else (pytest.mark.fitted,)
    name = entry.model_type + (f"-{entry.variant}" if entry.variant else "")
    return pytest.param(entry, id=name, marks=marks)


@pytest.fixture
def zoo_dir(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    _vision_stack()
    entry: ZooEntry = request.param
    return _built(_cache_root(tmp_path_factory) / _dir_name(entry), entry.build)


# Builders changed since: Gemma 4's (its processor's settings where mlx-vlm reads them, its
# images attended both ways; v4: its audio tower) and Llama 4's.
_VERSIONS = {"gemma4": 4, "llama4": 3}


def _dir_name(entry: ZooEntry) -> str:
    version = _VERSIONS.get(entry.model_type, 2)
    return f"zoo-{entry.model_type}-{entry.variant or 'base'}-v{version}".replace(" ", "_")


@pytest.mark.parametrize("zoo_dir", [_param(e) for e in ZOO], indirect=True)
def test_each_family_does_what_the_table_says(make_engine: Callable[..., Engine],
                                              zoo_dir: Path) -> None:
    import json

    model_type = json.loads((zoo_dir / "config.json").read_text())["model_type"]
    family = family_of(model_type)
    assert family is not None, f"{model_type} is in the zoo but not in the table"
    entry = next(e for e in ZOO if zoo_dir.name == _dir_name(e))
    observed = observe(lambda path: make_engine(path, max_batch=8, prefill_chunk=16),
                       zoo_dir, text_reference=entry.text_reference)
    assert observed.support is family.support, (model_type, observed)
    if family.support is not Support.IMAGES:
        assert family.reason is not None and family.reason in (observed.reason or "")
        assert family.name in (observed.reason or "") or model_type in (observed.reason or "")


def test_every_family_in_the_table_has_a_checkpoint_in_the_zoo() -> None:
    zoo_types = {e.model_type for e in ZOO}
    for family in FAMILIES:
        assert zoo_types & set(family.model_types), f"{family.name}: no zoo checkpoint"
