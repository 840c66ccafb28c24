"""float16 KV on a float32 model (``EngineConfig.kv_dtype``), on the tiny model: half the
bytes a token, rows batched equal each alone and cancelling one leaves its siblings' tokens,
a resumed prefix equals a recomputed one, and the disk tier keeps float16 files apart;
refusals by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import phi3

from engine import Engine, EngineConfig
from engine.device.prefix.prefix_disk import disk_key
from engine.device.upstream.half_kv import has_half_kv, install_half_kv
from tests.conftest import greedy
from tests.engine.test_kv_bits import (
    alone_then_beside_a_cancel,
    images_beside_texts_equal_alone,
    resumed_and_recomputed,
)

pytestmark = pytest.mark.timeout(300)


def half(make_engine: Callable[..., Engine], **config: object) -> Engine:
    return make_engine(kv_dtype="float16", **{"max_batch": 16, **config})


def test_rows_batched_equal_alone_and_cancel_leaves_siblings(
        make_engine: Callable[..., Engine]) -> None:
    eng = half(make_engine, prefill_chunk=16, prefix_cache_bytes=0)
    float_stats = make_engine().stats()
    assert eng.stats().kv_bytes_per_token * 2 == float_stats.kv_bytes_per_token
    _, alone, batched = alone_then_beside_a_cancel(eng, greedy(20), seed=5)
    assert batched == alone


def test_the_cache_holds_float16_and_the_forward_stays_float32(
        make_engine: Callable[..., Engine]) -> None:
    eng = half(make_engine)
    composition = eng._runtime.composition
    assert composition is not None
    model = composition.built.model.model
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([[1, 2, 3]]), cache=cache)
    assert logits.dtype == mx.float32
    assert {layer.keys.dtype for layer in cache} == {mx.float16}
    assert {layer.values.dtype for layer in cache} == {mx.float16}


def test_a_resumed_prefix_equals_a_recomputed_one(make_engine: Callable[..., Engine]) -> None:
    hits, resumed, recomputed = resumed_and_recomputed(
        half(make_engine), half(make_engine, prefix_cache_bytes=0))
    assert hits > 0
    assert resumed == recomputed


def test_disk_files_of_float16_kv_are_kept_apart(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert disk_key(tmp_path, []) != disk_key(tmp_path, [], kv="float16")
    assert disk_key(tmp_path, []) == disk_key(tmp_path, [], kv="")


def test_float16_kv_beside_kv_bits_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_bits and kv_dtype"):
        EngineConfig(kv_bits=8, kv_dtype="float16")


def test_a_quantized_start_is_refused_by_name() -> None:
    """mlx-lm's quantized_kv_start switches a request's cache at a length; one batch cache
    would switch every row at once, so only 0 (quantized from the first token) is served."""
    assert EngineConfig(kv_bits=8, kv_quantized_start=0).kv_quantized_start == 0
    with pytest.raises(ValueError, match=r"kv_quantized_start=512 is not served.*siblings"):
        EngineConfig(kv_bits=8, kv_quantized_start=512)


def test_fused_projections_are_refused_by_name() -> None:
    """Phi-3 projects q, k and v in one ``qkv_proj``: no k_proj to make float16."""
    args = phi3.ModelArgs(model_type="phi3", hidden_size=32, num_hidden_layers=1,
                          intermediate_size=64, num_attention_heads=2, rms_norm_eps=1e-5,
                          vocab_size=64, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"k_proj and v_proj.*mlx_lm\.models\.phi3"):
        install_half_kv(phi3.Model(args))


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl", "qwen3_5"])
def test_image_rows_batch_beside_text_rows_on_float16_kv(
        make_engine: Callable[..., Engine], family_dirs: Callable[[str], Path],
        family: str) -> None:
    """Image rows (mlx-vlm's language model on the M-RoPE families) keep float16 KV too:
    batched beside text rows they equal each alone."""
    eng = half(make_engine, model=family_dirs(family), prefill_chunk=8)
    images_beside_texts_equal_alone(eng)
    composition = eng._runtime.composition
    assert composition is not None
    vision = composition.built.lanes.batch.vision
    assert vision is not None and vision.built is not None
    tower = vision.built
    # The M-RoPE families prefill image rows through the vision library's language model:
    # it writes float16 KV too, else a batch holding an image row widens to float32.
    assert not tower.library_prefill or has_half_kv(tower._vlm.language_model)
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.upstream.vision_caches import vision_library_caches

    cache = make_prompt_cache(composition.built.model.model)
    if tower.library_prefill:  # written as an image row's prefill writes it
        tower._vlm.language_model(mx.array([[1, 2, 3]]), cache=vision_library_caches(cache))
    else:
        tower._text_model(mx.array([[1, 2, 3]]), cache=cache)
    assert {layer.keys.dtype for layer in cache if getattr(layer, "keys", None) is not None
            } == {mx.float16}


def test_adapter_rows_keep_float16_kv_and_equal_alone(
        make_engine: Callable[..., Engine], tiny_model_dir: Path, tmp_path: Path) -> None:
    """A per-row LoRA on v_proj adds a float32 product to the float16 projection: the row's
    values stay float16, and adapter rows beside base rows equal each alone."""
    from engine import SamplingParams, TextRequest
    from testkit.adapters import make_adapter
    from tests.conftest import prompts_of_lengths

    adapter = str(make_adapter(tmp_path / "A", tiny_model_dir, seed=1))  # q_proj, v_proj
    eng = half(make_engine, max_batch=8)
    prompts = prompts_of_lengths(eng, [30, 12], seed=7)
    mix = [(p, a) for p in prompts for a in (None, adapter)]

    def params(a: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0.0, adapter=a)

    alone = [eng.submit(TextRequest(p, params(a))).result(timeout=60).token_ids
             for p, a in mix]
    handles = [eng.submit(TextRequest(p, params(a))) for p, a in mix]
    assert [h.result(timeout=60).token_ids for h in handles] == alone
    assert alone[0] != alone[1]  # the adapter is read
    composition = eng._runtime.composition
    assert composition is not None
    model = composition.built.model.model
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.adapters.row_adapters import adapters_of

    adapters = adapters_of(model)
    assert adapters is not None
    cache = make_prompt_cache(model)
    with adapters.rows([1]):  # the adapter's slot, as a batch forward runs it
        model(mx.array([[1, 2, 3]]), cache=cache)
    assert {layer.values.dtype for layer in cache} == {mx.float16}
