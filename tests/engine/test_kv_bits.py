"""KV in 8 and 4 bits inside the shared batch (``EngineConfig.kv_bits``), on the tiny model
(heads of 32, so groups of 32): rows batched equal each alone and cancelling one leaves its
siblings' tokens; prefix reuse resumes quantized blocks exactly; fast-forward and
speculation rewind on them; the KV admission counts their real bytes; refusals by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import (
    Engine,
    EngineConfig,
    InvalidRequestError,
    JsonSchema,
    SamplingParams,
)
from tests.conftest import Turns, greedy, prompts_of_lengths, request_for

pytestmark = pytest.mark.timeout(300)
BITS = [8, 4]


def quantized(make_engine: Callable[..., Engine], bits: int, model: Path | None = None,
              **config: object) -> Engine:
    return make_engine(model, kv_bits=bits, kv_group_size=32, **{"max_batch": 16, **config})


def alone_then_beside_a_cancel(eng: Engine, params: SamplingParams, seed: int,
                               ) -> tuple[list[list[int]], list[tuple[int, ...]],
                                          list[tuple[int, ...]]]:
    """Five prompts of mixed lengths run each alone, then batched beside a row cancelled
    while it prefills: (prompts, tokens alone, tokens batched)."""
    prompts = prompts_of_lengths(eng, [5, 40, 13, 77, 21], seed=seed)
    alone = [eng.submit(request_for(p, params)).result(timeout=60).token_ids for p in prompts]
    handles = [eng.submit(request_for(p, params)) for p in prompts]
    doomed = eng.submit(request_for(prompts_of_lengths(eng, [30], seed=9)[0], greedy(200)))
    doomed.cancel()
    return prompts, alone, [h.result(timeout=60).token_ids for h in handles]


def resumed_and_recomputed(eng: Engine, cold: Engine,
                           ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """A second prompt sharing a 60-token head with a first: the prefix tokens it found on
    ``eng``, its tokens there, and its tokens on ``cold`` (no prefix store)."""
    head = prompts_of_lengths(eng, [60], seed=3)[0]
    params = greedy(12)
    eng.submit(request_for([*head, 11, 12], params)).result(timeout=60)
    before = eng.stats().prefix_hit_tokens
    again = eng.submit(request_for([*head, 21, 22, 23], params)).result(timeout=60)
    hits = eng.stats().prefix_hit_tokens - before
    recomputed = cold.submit(request_for([*head, 21, 22, 23], params)).result(timeout=60)
    return hits, again.token_ids, recomputed.token_ids


@pytest.mark.parametrize("bits", BITS)
def test_rows_batched_equal_alone_and_cancel_leaves_siblings(
        make_engine: Callable[..., Engine], bits: int) -> None:
    eng = quantized(make_engine, bits, prefill_chunk=16, prefix_cache_bytes=0)
    stats = eng.stats()
    assert f"KVCache({bits}-bit)" in stats.cache_kinds and stats.kv_bits == bits
    float_stats = make_engine().stats()
    assert float_stats.kv_bits == 0
    # Groups of 32, float16 scales and biases: (bits + 32/32) / 32 of float32's bytes.
    assert stats.kv_bytes_per_token * 32 == (bits + 1) * float_stats.kv_bytes_per_token
    params = greedy(20)
    prompts, alone, batched = alone_then_beside_a_cancel(eng, params, seed=bits)
    assert batched == alone
    float_eng = make_engine(max_batch=16)
    plain = [float_eng.submit(request_for(p, params)).result(timeout=60).token_ids
             for p in prompts]
    assert any(a != p for a, p in zip(alone, plain)) or bits == 8  # 4 bits moves tokens


@pytest.mark.parametrize("bits", BITS)
def test_a_resumed_quantized_prefix_equals_a_recomputed_one(
        make_engine: Callable[..., Engine], bits: int) -> None:
    hits, resumed, recomputed = resumed_and_recomputed(
        quantized(make_engine, bits), quantized(make_engine, bits, prefix_cache_bytes=0))
    assert hits > 0
    assert resumed == recomputed


@pytest.mark.parametrize("bits", BITS)
def test_fast_forward_and_speculation_rewind_on_quantized_rows(
        make_engine: Callable[..., Engine], bits: int) -> None:
    schema = JsonSchema({"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lisbon"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False})
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=schema)
    on = quantized(make_engine, bits)
    composition = on._runtime.composition
    assert composition is not None  # every span taken: the cost model has its own tests
    composition.built.lanes.batch.costs.shortest = lambda spans, width, rows: 2
    off = quantized(make_engine, bits, fast_forward=False, speculation=0)
    prompts = prompts_of_lengths(on, [12, 30, 7], seed=5)
    expected = [off.submit(request_for(p, params)).result(timeout=60).token_ids
                for p in prompts]
    handles = [on.submit(request_for(p, params)) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == expected
    assert on.stats().forced_tokens > 0


def test_the_admission_counts_the_quantized_bytes(make_engine: Callable[..., Engine]) -> None:
    per_row = {}
    for bits in (None, 8):
        turns = Turns()
        eng = make_engine(kv_bits=bits, kv_group_size=32, probe=turns.probe)
        prompt = prompts_of_lengths(eng, [10])[0]
        eng.submit(request_for(prompt, greedy(246))).result(timeout=60)
        per_row[bits] = next(r.kv_bytes_projected for r in turns.reports if r.admitted)
    # Groups of 32 with float16 scales and biases: (8 + 32/32) / 32 of float32's bytes.
    assert per_row[8] <= 0.29 * per_row[None]
    budget = per_row[None] * 4  # four float rows' worth
    admitted = {}
    for bits in (None, 8):
        eng = make_engine(kv_bits=bits, kv_group_size=32, kv_budget_bytes=budget,
                          max_batch=32, prefix_cache_bytes=0)
        prompts = prompts_of_lengths(eng, [10] * 16, seed=1)
        handles = [eng.submit(request_for(p, greedy(246))) for p in prompts]
        for h in handles:
            h.result(timeout=120)
        admitted[bits] = eng.stats().peak_running
    assert admitted[8] >= 1.9 * admitted[None]


def test_settings_that_cannot_hold_refuse_by_name(make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(ValueError, match="kv_bits cannot be used with max_kv_size"):
        EngineConfig(kv_bits=8, max_kv_size=256)
    with pytest.raises(Exception, match="kv_group_size=64 does not divide the model's head"):
        make_engine(kv_bits=8, kv_group_size=64)
    with pytest.raises(ValueError):
        EngineConfig(kv_bits=3)  # type: ignore[arg-type]
    assert InvalidRequestError  # the request-level refusals are the engine's usual ones


@pytest.mark.parametrize("bits", BITS)
def test_the_disk_tier_stores_quantized_blocks_and_only_its_setting_reads_them(
        tiny_model_dir: Path, tmp_path: Path, bits: int) -> None:
    from tests.engine.test_prefix_disk import answer, files

    setting = {"kv_bits": bits, "kv_group_size": 32}
    cold, _ = answer(tiny_model_dir, "What is second?", prefix_cache_bytes=0, **setting)
    answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path), **setting)
    assert files(tmp_path)
    second, stats = answer(tiny_model_dir, "What is second?", prefix_cache_dir=str(tmp_path),
                           **setting)
    assert second.token_ids == cold.token_ids  # resumed from disk, bit for bit
    assert stats.prefix_disk_hits == 1 and second.usage.cached_tokens > 100
    # Another setting (float KV, or the other bit width) never reads these files.
    _, other = answer(tiny_model_dir, "What is third?", prefix_cache_dir=str(tmp_path))
    assert other.prefix_disk_hits == 0


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl", "qwen3_5"])
def test_image_rows_batch_beside_text_rows_on_quantized_kv(
        make_engine: Callable[..., Engine], family_dirs: Callable[[str], Path],
        family: str) -> None:
    images_beside_texts_equal_alone(
        quantized(make_engine, 8, model=family_dirs(family), prefill_chunk=8))


def images_beside_texts_equal_alone(eng: Engine) -> None:
    """Two image rows batched beside two text rows each give their tokens alone (a vision
    family's engine at a KV setting; test_kv_dtype's image test runs it too)."""
    from tests.engine.test_vision import BLUE, RED, asking, image_part, tokens, with_texts_batched

    params = greedy(10)
    images = [asking(image_part(RED)), asking(image_part(BLUE, seed=2, size=(90, 40)))]
    texts = prompts_of_lengths(eng, [20, 9], seed=4)
    alone = [tokens(eng, m, params) for m in images]
    alone_texts, results = with_texts_batched(eng, texts, images, params)
    assert results == alone_texts + alone
