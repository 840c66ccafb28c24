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
from engine.device.loading.half_kv import install_half_kv
from engine.device.prefix.prefix_disk import disk_key
from tests.conftest import greedy
from tests.engine.test_kv_bits import alone_then_beside_a_cancel, resumed_and_recomputed

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
