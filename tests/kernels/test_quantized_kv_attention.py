"""The attention kernel over a quantized KV cache (``cpu_kernels.quantized_attention``):
against mlx-lm's ``quantized_scaled_dot_product_attention`` over bits, group sizes, grouped
heads, every mask form (left padding included), one query and several; each lower
instruction set too; and inside the engine, ``kv_bits`` rows batched equal each alone with
the kernel taking the model's attention."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from engine import Engine
from engine.device.kernels import cpu_kernels, kernel_layers
from tests.conftest import greedy, prompts_of_lengths, request_for

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 2e-5  # float32 throughout; mlx-lm sums in another order

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernels_available(),
    reason=f"CPU kernels unavailable here: {cpu_kernels.kernel_status().reason}")


def _causal_mask(pads: list[int], queries: int, keys: int) -> mx.array:
    """(B, 1, queries, keys) boolean: causal, each row's first ``pads[row]`` keys hidden."""
    allowed = np.arange(keys - queries, keys)[:, None] >= np.arange(keys)[None]
    mask = np.repeat(allowed[None], len(pads), axis=0)
    for row, pad in enumerate(pads):
        mask[row, :, :pad] = False
    return mx.array(mask[:, None])


def _quantized(x: mx.array, group: int, bits: int, dtype: mx.Dtype,
               length: int) -> cpu_kernels.Triple:
    """``x`` quantized as the caches keep it, cut to ``length`` keys (a view of a longer
    buffer, as a cache hands it out)."""
    packed, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    return packed[:, :, :length], scales.astype(dtype)[:, :, :length], \
        biases.astype(dtype)[:, :, :length]


def max_error_against_mlx_lm(seed: int = 0) -> float:
    """The largest absolute difference from mlx-lm's quantized attention over the matrix;
    asserts each case is within TOLERANCE."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for bits, group, (heads, kv_heads), queries, dim, scales_dtype in itertools.product(
            (4, 8), (32, 64), ((9, 3), (4, 4), (8, 2)), (1, 3), (64, 128),
            (mx.float16, mx.float32)):
        batch, keys = 3, 70
        q = mx.array(rng.standard_normal((batch, heads, queries, dim)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((batch, kv_heads, keys + 20, dim))
                         .astype(np.float32)) for _ in range(2))
        qk = _quantized(k, group, bits, scales_dtype, keys)
        qv = _quantized(v, group, bits, scales_dtype, keys)
        scale = dim ** -0.5
        boolean = _causal_mask([0, 5, 17], queries, keys)
        additive = mx.where(boolean, 0.0, -np.inf).astype(mx.float32)
        for mask, causal, ref_mask in ((None, False, None), (None, True, "causal"),
                                       (boolean, False, boolean), (additive, False, additive)):
            out = cpu_kernels.quantized_attention(q, qk, qv, scale, group, bits, mask, causal)
            ref = quantized_scaled_dot_product_attention(q, qk, qv, scale, ref_mask,
                                                         group_size=group, bits=bits)
            assert out.shape == ref.shape and out.dtype == mx.float32
            err = float(mx.abs(out - ref).max().item())
            assert err < TOLERANCE, (bits, group, heads, kv_heads, queries, dim,
                                     scales_dtype, causal, err)
            worst = max(worst, err)
    return worst


def test_equals_mlx_lm_quantized_attention() -> None:
    assert max_error_against_mlx_lm() < TOLERANCE


def test_a_left_padded_row_equals_it_alone_and_padding_is_never_read() -> None:
    """Bit for bit: the keys before a row's padding hold other values in the batch."""
    rng = np.random.default_rng(1)
    batch, heads, kv_heads, dim, keys, pads = 3, 9, 3, 64, 150, [0, 5, 97]
    q = mx.array(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((batch, kv_heads, keys, dim)).astype(np.float32))
            for _ in range(2))
    for bits in (4, 8):
        qk, qv = _quantized(k, 32, bits, mx.float16, keys), _quantized(v, 32, bits,
                                                                       mx.float16, keys)
        batched = cpu_kernels.quantized_attention(q, qk, qv, 0.125, 32, bits,
                                                  _causal_mask(pads, 1, keys))
        for row, pad in enumerate(pads):
            alone = cpu_kernels.quantized_attention(
                q[row:row + 1], tuple(t[row:row + 1, :, pad:] for t in qk),  # type: ignore[arg-type]
                tuple(t[row:row + 1, :, pad:] for t in qv), 0.125, 32, bits)  # type: ignore[arg-type]
            assert mx.array_equal(batched[row:row + 1], alone).item(), (bits, row)


def test_shapes_it_does_not_take_are_refused_by_name() -> None:
    q = mx.zeros((1, 2, 1, 64))
    triple = _quantized(mx.zeros((1, 2, 4, 64)), 64, 8, mx.float16, 4)
    assert cpu_kernels.quantized_attention_supported(q, triple, triple, 64, 8)
    assert not cpu_kernels.quantized_attention_supported(q, triple, triple, 64, 3)
    assert not cpu_kernels.quantized_attention_supported(mx.zeros((1, 2, 1, 32)), triple,
                                                         triple, 64, 8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        cpu_kernels.quantized_attention(q, triple, triple, 0.125, 64, 2)


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_the_lower_instruction_sets_match_too(isa: str) -> None:
    if cpu_kernels.kernel_status().isa not in ("avx512", "avx2") or (
            isa == "avx2" and cpu_kernels.kernel_status().isa == "avx2"):
        pytest.skip(f"{isa} is not a lower instruction set here")
    env = {**os.environ, "MLX_PROVIDERS_CPU_ISA": isa}
    code = ("import engine\n"
            "from engine.device.kernels import cpu_kernels\n"
            "from tests.kernels.test_quantized_kv_attention import max_error_against_mlx_lm\n"
            "print(cpu_kernels.kernel_status().isa, max_error_against_mlx_lm())\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2] == isa


def test_kv_bits_rows_batched_equal_alone_on_the_kernel(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """``EngineConfig(kv_bits=8, kv_group_size=32)`` on the tiny model: the kernel takes the
    model's attention (prefill and decode), and batched rows equal each alone."""
    calls = []
    real = cpu_kernels.quantized_attention

    def counted(*args: object, **kwargs: object) -> mx.array:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_layers.cpu_kernels, "quantized_attention", counted)
    eng = make_engine(kv_bits=8, kv_group_size=32, max_batch=16, prefill_chunk=16,
                      prefix_cache_bytes=0)
    params = greedy(16)
    prompts = prompts_of_lengths(eng, [5, 40, 13, 77, 21], seed=8)
    alone = [eng.submit(request_for(p, params)).result(timeout=60).token_ids for p in prompts]
    assert calls, "the quantized-KV kernel never ran"
    handles = [eng.submit(request_for(p, params)) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == alone
