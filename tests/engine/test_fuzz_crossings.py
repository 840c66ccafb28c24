"""The interaction fuzz: generated requests that combine two to four features, one to six of
them batched, cancelled or timed out at random points, on tiny models of several families.

Invariants, whatever was drawn:
- a row that runs to its end equals the same row alone on the same engine (tokens, text,
  finish, logprobs; a stream's events carry exactly its tokens);
- a cancelled or timed-out row's tokens are a prefix of its run to the end, and a row
  cancelled in its prefill has none;
- every failure is typed (the engine's own errors, naming their cause), and only a
  timeout may fail a row that the compatibility table serves;
- nothing is left behind: rows, pending requests, grammar matchers, KV, image jobs,
  pinned adapters; the prefix store within its bound.

Bounded for ``make test`` (``MLX_PROVIDERS_CROSSING_EXAMPLES`` in all, default 48: 12 a
family); ``make fuzz`` runs 2,000.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.compatibility import Feature, Kind, Status, verdict
from testkit.crossings import (
    BASE_CONFIG,
    MATRIX_MODEL,
    SYSTEM,
    Assets,
    Draft,
    Served,
    build_matrix_vlm,
    draft_of,
    settled,
    start_engine,
)
from tests.conftest import _built, _cache_root, _vision_stack

pytestmark = pytest.mark.timeout(3600)

FAMILIES = ("qwen2_vl", "qwen2_vl_f16", "gemma3", "qwen2_serial")
EXAMPLES = -(-int(os.environ.get("MLX_PROVIDERS_CROSSING_EXAMPLES", "48")) // len(FAMILIES))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
QUESTIONS = ["What is the weather in Paris?", "Is it raining in Oslo?", "Name a colour.",
             "Say yes or no.", "Count to three."]
ROW_FEATURES = [f for f in Feature if f.kind is not Kind.ENGINE]


@dataclass(frozen=True)
class Family:
    """A tiny model, its assets, and the request features its checkpoint can take."""

    name: str
    served: Served
    assets: Assets
    features: tuple[Feature, ...]
    system: str = SYSTEM


def _adapter_for(model: Path, tmp: pytest.TempPathFactory, name: str) -> str:
    from testkit.adapters import make_adapter

    return str(make_adapter(tmp.mktemp(f"fuzz-{name}") / "a", model, seed=7, rank=4))


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory,
             tiny_model_dir: Path) -> Iterator[dict[str, Family]]:
    """Four engines: a reasoning Qwen2-VL with every speed-up on, the same keeping its KV in
    float16 (``kv_dtype``), a Gemma 3 VLM (a fixed image block, sliding windows) with the
    defaults, and the text qwen2 whose rows all run on the serial lane."""
    _vision_stack()
    from engine.models.embedding_model import resolve_embedding_model
    from testkit.vision_model import build_tiny_vlm

    try:
        embedding: Path | None = resolve_embedding_model()
    except Exception:  # offline without the wheel: no embeddings are drawn
        embedding = None
    root = _cache_root(tmp_path_factory)
    qwen = _built(root / MATRIX_MODEL, build_matrix_vlm)
    gemma = _built(root / "tiny-gemma3-vlm-v2", build_tiny_vlm)
    every = tuple(f for f in ROW_FEATURES if embedding is not None or
                  f is not Feature.EMBEDDINGS)
    speedups = {**BASE_CONFIG, "fast_forward": True, "speculation": 4,
                "prefix_cache_bytes": 32 << 20}
    found: dict[str, Family] = {}
    for name, model, config, serial, features, system in (
            ("qwen2_vl", qwen, speedups, None, every, SYSTEM),
            ("qwen2_vl_f16", qwen, {**speedups, "kv_dtype": "float16"}, None, every, SYSTEM),
            ("gemma3", gemma, {"max_batch": 8, "prefill_chunk": 16}, None,
             tuple(f for f in every if f is not Feature.REASONING_BUDGET), SYSTEM),
            # Rows one at a time there: a short system prompt keeps each example quick.
            ("qwen2_serial", tiny_model_dir, {**BASE_CONFIG, "fast_forward": True}, "qwen2",
             tuple(f for f in every if f not in (Feature.IMAGES, Feature.REASONING_BUDGET)),
             "You answer questions about the weather.")):
        assets = Assets(model, _adapter_for(model, tmp_path_factory, name), embedding)
        found[name] = Family(name, start_engine(model, config, serial=serial,
                                                embedding_model=embedding), assets, features,
                             system)
    yield found
    for family in found.values():
        family.served.engine.close()


@st.composite
def row_features(draw: st.DrawFn, allowed: tuple[Feature, ...]) -> frozenset[Feature]:
    """Two to four features a row can have together (no alternatives, one ending)."""
    chosen: list[Feature] = []
    for feature in draw(st.permutations(allowed)):
        if len(chosen) == 4:
            break
        if all(verdict(feature, other).status in (Status.SERVED, Status.INERT)
               for other in chosen):
            chosen.append(feature)
    count = draw(st.integers(2, 4))
    return frozenset(chosen[:count])


@st.composite
def rows(draw: st.DrawFn, family: Family) -> list[Draft]:
    drafts = []
    for _ in range(draw(st.integers(1, 6))):
        features = draw(row_features(family.features))
        draft = draft_of(features, family.assets, question=draw(st.sampled_from(QUESTIONS)),
                         system=family.system)
        if draft.cancel == "decode":
            draft = replace(draft, cancel_after=draw(st.integers(1, 6)))
        if draft.timeout is not None:
            draft = replace(draft, timeout=draw(st.floats(0.005, 0.3)))
        drafts.append(draft)
    return drafts


def check(family: Family, drafts: list[Draft]) -> None:
    served = family.served
    if os.environ.get("MLX_PROVIDERS_FUZZ_TRACE"):  # which example a hang came from
        print("EXAMPLE", json.dumps([[sorted(f.value for f in d.features), d.question,
                                      d.cancel_after, d.timeout] for d in drafts]), flush=True)
    alone = [served.alone(d.to_the_end()) for d in drafts]
    outcomes = served.run(drafts)
    for draft, outcome, reference in zip(drafts, outcomes, alone):
        assert reference.finish != "error", reference.error
        if draft.ends_early:
            if outcome.finish == "error":  # only a timeout fails a served row
                assert outcome.error.startswith("RequestTimeoutError: "), outcome.error
            assert outcome.tokens == reference.tokens[:len(outcome.tokens)]
            if draft.cancel == "prefill":
                assert outcome.tokens == ()
        else:
            assert outcome == reference, (draft, outcome, reference)
            if draft.stream:
                assert outcome.streamed == outcome.tokens
    left = settled(served.engine)
    assert not any(left.values()), f"left behind: {left}"
    stats = served.engine.stats()
    assert stats.prefix_bytes <= max(stats.prefix_cache_limit_bytes, 0)
    if served.kv_dtypes is not None:  # kv_dtype: every row's cache held float16 KV
        assert served.kv_dtypes.seen == {"float16"}, served.kv_dtypes.seen


@pytest.mark.parametrize("name", FAMILIES)
def test_generated_crossings_are_served_exactly(families: dict[str, Family],
                                                name: str) -> None:
    family = families[name]

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check(family, data.draw(rows(family)))

    run()
