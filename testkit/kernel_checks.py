"""Checks of the CPU kernels against MLX's own ops, shared by the tests and by the
subprocesses that run them under a lower instruction set (``MLX_PROVIDERS_CPU_ISA``).

Each check raises ``AssertionError`` on a mismatch; ``python -m testkit.kernel_checks`` runs
them all and prints the kernel set it ran on.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import engine  # noqa: F401 - the fast BLAS before mlx
from engine.device.kernels import cpu_kernels

FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def quantized_weights(rng: np.random.Generator, n: int, k: int, bits: int, group: int,
                      dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """``mx.quantize`` of a random (n, k) matrix, scales and biases in ``dtype``."""
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return wq, scales, biases


def check_quantized_matmul(seed: int = 0, *, ks: tuple[int, ...] = (64, 96, 576),
                           rows: tuple[int, ...] = (1, 3, 4, 5, 17, 64, 70)) -> None:
    """Against float64 products of MLX's own dequantized weights: the kernel dequantizes
    exactly and sums in float32, so only the summation order differs (relative 1e-5)."""
    rng = np.random.default_rng(seed)
    for bits, group, dtype in itertools.product((4, 8), (32, 64), FLOATS):
        for k in ks:
            if k % group:
                continue
            wq, scales, biases = quantized_weights(rng, 37, k, bits, group, dtype)
            dense = _np(mx.dequantize(wq, scales, biases, group_size=group, bits=bits))
            for m in rows:
                x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                out = cpu_kernels.quantized_matmul(x, wq, scales, biases, group, bits)
                assert out.dtype == mx.quantized_matmul(
                    x[:1], wq, scales, biases, transpose=True, group_size=group, bits=bits).dtype
                ref = _np(x) @ dense.T
                err = np.abs(_np(out) - ref).max() / np.abs(ref).max()
                tol = 1e-5 if dtype == mx.float32 else 1e-2  # then the output is rounded
                assert err < tol, (bits, group, dtype, k, m, err)


def check_rows_are_independent(seed: int = 1) -> None:
    """A row's product is the same bits whatever rows share its call (batched == alone)."""
    rng = np.random.default_rng(seed)
    for bits, group in itertools.product((4, 8), (32, 64)):
        wq, scales, biases = quantized_weights(rng, 53, 192, bits, group, mx.float32)
        x = mx.array(rng.standard_normal((70, 192)).astype(np.float32))
        whole = cpu_kernels.quantized_matmul(x, wq, scales, biases, group, bits)
        for start, stop in ((0, 1), (5, 6), (3, 7), (64, 70), (13, 30)):
            part = cpu_kernels.quantized_matmul(x[start:stop], wq, scales, biases, group, bits)
            assert mx.array_equal(part, whole[start:stop]).item(), (bits, group, start, stop)


def check_strided_activations(seed: int = 2) -> None:
    """Views (a transposed, a sliced, a batched 3-D activation) give the contiguous result."""
    rng = np.random.default_rng(seed)
    wq, scales, biases = quantized_weights(rng, 40, 128, 4, 32, mx.float32)
    base = mx.array(rng.standard_normal((128, 9)).astype(np.float32))
    views = [base.T, mx.array(rng.standard_normal((9, 256)).astype(np.float32))[:, ::2],
             mx.array(rng.standard_normal((2, 3, 128)).astype(np.float32))]
    for view in views:
        got = cpu_kernels.quantized_matmul(view, wq, scales, biases, 32, 4)
        want = cpu_kernels.quantized_matmul(mx.array(np.array(view)), wq, scales, biases, 32, 4)
        assert got.shape == (*view.shape[:-1], 40)
        assert mx.array_equal(got, want).item()


def _mask(left_pad: list[int], queries: int, keys: int) -> mx.array:
    """mlx-lm's batch mask: causal over the last ``queries`` positions, left padding off."""
    rinds = mx.arange(keys)[None]
    linds = mx.arange(keys - queries, keys)[:, None]
    pad = mx.array(left_pad)[:, None, None, None]
    return (linds >= rinds)[None, None] & (pad <= rinds)


def check_attention(seed: int = 3) -> None:
    """Against ``mx.fast.scaled_dot_product_attention`` in float32: grouped heads, head
    sizes the SIMD units special-case and others, every mask kind, views of a longer cache."""
    rng = np.random.default_rng(seed)
    for dim, (heads, kv_heads), dtype, queries in itertools.product(
            (64, 128, 80, 32), ((9, 3), (4, 4), (8, 2)), FLOATS, (1, 3)):
        batch, keys = 3, 70

        def arr(*shape: int, dtype: mx.Dtype = dtype) -> mx.array:
            return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

        q = arr(batch, heads, queries, dim)
        k_cache = arr(batch, kv_heads, keys + 30, dim)
        v_cache = arr(batch, kv_heads, keys + 30, dim)
        k, v = k_cache[:, :, :keys], v_cache[:, :, :keys]  # views, as a KV cache hands out
        scale = dim ** -0.5
        boolean = _mask([0, 5, 17], queries, keys)
        additive = mx.where(boolean, 0.0, -np.inf).astype(mx.float32)
        f32 = [t.astype(mx.float32) for t in (q, k, v)]
        for mask, causal, ref_mask in ((None, False, None), (None, True, "causal"),
                                       (boolean, False, boolean), (additive, False, additive)):
            out = cpu_kernels.attention(q, k, v, scale, mask, causal)
            ref = mx.fast.scaled_dot_product_attention(*f32, scale=scale, mask=ref_mask)
            assert out.dtype == dtype and out.shape == ref.shape
            err = mx.abs(out.astype(mx.float32) - ref).max().item()
            tol = 2e-6 if dtype == mx.float32 else 2e-2  # then the output is rounded
            assert err < tol, (dim, heads, kv_heads, dtype, queries, causal, err)


def check_attention_batched_equals_alone(seed: int = 4) -> None:
    """A left-padded row gives the same bits as the row alone, and the padded keys are never
    read: NaN there changes nothing."""
    rng = np.random.default_rng(seed)
    batch, heads, kv_heads, dim, keys = 3, 9, 3, 64, 200
    pads = [0, 5, 117]
    q = mx.array(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32))
    k = np.array(rng.standard_normal((batch, kv_heads, keys, dim)).astype(np.float32))
    v = np.array(rng.standard_normal((batch, kv_heads, keys, dim)).astype(np.float32))
    for row, pad in enumerate(pads):
        k[row, :, :pad] = np.nan
        v[row, :, :pad] = np.nan
    batched = cpu_kernels.attention(q, mx.array(k), mx.array(v), 0.125, _mask(pads, 1, keys))
    for row, pad in enumerate(pads):
        alone = cpu_kernels.attention(q[row:row + 1], mx.array(k[row:row + 1, :, pad:]),
                                      mx.array(v[row:row + 1, :, pad:]), 0.125)
        assert mx.array_equal(batched[row:row + 1], alone).item(), row


def check_silu_mul(seed: int = 5) -> None:
    """Against ``nn.silu(gate) * up``, float32 to a few ulps, the half types to their ulp."""
    rng = np.random.default_rng(seed)
    for n, dtype in itertools.product((5, 16, 1000, 70000), FLOATS):
        gate = mx.array((6 * rng.standard_normal(n)).astype(np.float32)).astype(dtype)
        up = mx.array(rng.standard_normal(n).astype(np.float32)).astype(dtype)
        out = cpu_kernels.silu_mul(gate, up)
        ref = nn.silu(gate.astype(mx.float32)) * up.astype(mx.float32)
        err = mx.abs(out.astype(mx.float32) - ref) / (mx.abs(ref) + 1e-3)
        assert out.dtype == dtype
        assert err.max().item() < (1e-5 if dtype == mx.float32 else 1e-2), (n, dtype)


def check_many_equals_one(seed: int = 6) -> None:
    """``quantized_matmul_many`` (q/k/v, gate/up in one op) gives each weight the bits its own
    ``quantized_matmul`` gives, on the float path and, where the CPU has it, the int8 one."""
    rng = np.random.default_rng(seed)
    paths = (False, True) if cpu_kernels.int8_path() else (False,)
    for bits, group, dtype, int8 in itertools.product((4, 8), (32, 64), FLOATS, paths):
        weights = [quantized_weights(rng, n, 128, bits, group, dtype) for n in (40, 16, 33)]
        for m in (1, 5, 70):
            x = mx.array(rng.standard_normal((m, 128)).astype(np.float32)).astype(dtype)
            many = cpu_kernels.quantized_matmul_many(
                x, [w[0] for w in weights], [w[1] for w in weights], [w[2] for w in weights],
                group, bits, int8)
            for got, (wq, scales, biases) in zip(many, weights):
                one = cpu_kernels.quantized_matmul(x, wq, scales, biases, group, bits, int8)
                assert got.dtype == one.dtype and got.shape == one.shape
                assert mx.array_equal(got, one).item(), (bits, group, dtype, int8, m)


def check_int8_matmul(seed: int = 7) -> None:
    """The int8 path (where the CPU has it) computes its formula: activations rounded to
    int8 in blocks of 32 (scale max|x| / 127), integer products scaled per block, the
    weights' biases against the exact block sums; a row's bits never depend on its batch.
    Elsewhere ``int8=True`` is the float path, bit for bit."""
    rng = np.random.default_rng(seed)
    for bits, group in itertools.product((4, 8), (32, 64)):
        wq, scales, biases = quantized_weights(rng, 37, 192, bits, group, mx.float32)
        x = mx.array(rng.standard_normal((70, 192)).astype(np.float32))
        out = cpu_kernels.quantized_matmul(x, wq, scales, biases, group, bits, int8=True)
        if not cpu_kernels.int8_path():
            same = cpu_kernels.quantized_matmul(x, wq, scales, biases, group, bits)
            assert mx.array_equal(out, same).item()
            continue
        s = np.repeat(_np(scales), group, axis=1)
        b = np.repeat(_np(biases), group, axis=1)
        codes = np.round((_np(mx.dequantize(wq, scales, biases, group_size=group,
                                            bits=bits)) - b) / s)
        blocks = _np(x).reshape(70, -1, 32)
        x_scale = np.abs(blocks).max(-1, keepdims=True) / 127
        x_codes = np.round(blocks / x_scale)
        formula = ((x_codes * x_scale).reshape(70, 192) @ (codes * s).T
                   + _np(x) @ b.T)
        err = np.abs(_np(out) - formula).max() / np.abs(formula).max()
        assert err < 1e-5, (bits, group, err)
        for start, stop in ((0, 1), (5, 6), (3, 7), (64, 70), (13, 30)):
            part = cpu_kernels.quantized_matmul(x[start:stop], wq, scales, biases, group, bits,
                                                int8=True)
            assert mx.array_equal(part, out[start:stop]).item(), (bits, group, start, stop)


def check_rms_norm(seed: int = 8) -> None:
    """Against ``mx.fast.rms_norm`` (MLX's CPU fallback): with and without a weight, over
    views, to a few float32 ulps (only the order of the sum of squares differs)."""
    rng = np.random.default_rng(seed)
    for shape in ((1, 1, 576), (4, 576), (3, 7, 100), (600, 64)):
        x = mx.array((3 * rng.standard_normal(shape)).astype(np.float32))
        weight = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
        for w in (weight, None):
            out = cpu_kernels.rms_norm(x, w, 1e-5)
            ref = mx.fast.rms_norm(x, w, 1e-5)
            assert out.dtype == mx.float32 and out.shape == ref.shape
            assert mx.abs(out - ref).max().item() < 1e-5, (shape, w is None)
    x = mx.array(rng.standard_normal((8, 256)).astype(np.float32))[:, ::2]
    assert mx.abs(cpu_kernels.rms_norm(x, None, 1e-6)
                  - mx.fast.rms_norm(x, None, 1e-6)).max().item() < 1e-5


def check_rope(seed: int = 9) -> None:
    """Against ``mx.fast.rope``: both layouts, partial dims, a base or frequencies, 3-5 axes,
    one offset or one a row, a transposed view as attention hands it over; a row of a batch
    gets the bits it gets alone at its own offset."""
    rng = np.random.default_rng(seed)
    for shape, dims, traditional, freqs_given in itertools.product(
            ((1, 9, 1, 64), (3, 4, 17, 64), (2, 5, 32), (2, 3, 2, 4, 48)), (32, 0),
            (False, True), (False, True)):
        dims = dims or shape[-1]
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        freqs = (mx.array((0.5 + np.abs(rng.standard_normal(dims // 2))).astype(np.float32))
                 if freqs_given else None)
        base = None if freqs_given else 10000.0
        for offset in (0, 37, mx.array(list(range(5, 5 + shape[0])), dtype=mx.int32)):
            out = cpu_kernels.rope(x, dims, traditional, base, 0.5, offset, freqs)
            ref = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=0.5,
                               offset=offset, freqs=freqs)
            assert mx.abs(out - ref).max().item() < 2e-5, (shape, dims, traditional, offset)
    heads = mx.array(rng.standard_normal((3, 17, 9, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
    offsets = [3, 900, 41]
    batched = cpu_kernels.rope(heads, 64, False, 10000.0, 1.0, mx.array(offsets, dtype=mx.int32))
    ref = mx.fast.rope(heads, 64, traditional=False, base=10000.0, scale=1.0,
                       offset=mx.array(offsets))
    assert mx.abs(batched - ref).max().item() < 5e-4  # cos/sin of ~900 in float32
    for row, offset in enumerate(offsets):
        alone = cpu_kernels.rope(heads[row:row + 1], 64, False, 10000.0, 1.0, offset)
        assert mx.array_equal(alone, batched[row:row + 1]).item(), row


ALL = (check_quantized_matmul, check_rows_are_independent, check_strided_activations,
       check_attention, check_attention_batched_equals_alone, check_silu_mul,
       check_many_equals_one, check_int8_matmul, check_rms_norm, check_rope)


if __name__ == "__main__":
    for check in ALL:
        check()
    print(cpu_kernels.kernel_status().isa)
