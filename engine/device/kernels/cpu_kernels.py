"""The native CPU kernels (``engine.device.kernels.cpu_native``, built from ``native/`` at install).

Two operations of the MLX graph, for the CPU backend only: a quantized matmul over MLX's
affine 4/8-bit layout (float32 activations, weights dequantized exactly in registers;
AVX-512 / AVX2 / NEON units chosen at run time, several threads)
and a fused attention for decode steps, over float keys and values or over a KV cache kept
quantized (``mx.quantize``'s triples, read where they lie). This module loads the extension
once, checks it (the mlx it was built against, a small product against MLX's own op) and
says why when it cannot be used: then MLX's own ops run, as before.

``MLX_PROVIDERS_CPU_KERNELS=0`` turns the kernels off (the reference path, for tests and
comparisons); ``MLX_PROVIDERS_CPU_ISA`` picks a lower instruction set, and
``MLX_PROVIDERS_CPU_THREADS`` the thread count (both read once, when the extension loads).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import mlx.core as mx

ENV_SWITCH = "MLX_PROVIDERS_CPU_KERNELS"
ATTENTION_MAX_QUERIES = 32  # longer query spans (prefill) keep MLX's GEMM-based attention
QMM_BITS = (4, 8)
QMM_GROUPS = (32, 64)
QATTN_BITS = (4, 8)  # what quantized_attention reads (mx.quantize's affine layout)
QATTN_GROUPS = (32, 64, 128)
ATTENTION_MAX_DIM = 256

# mx.quantize's (packed uint32, scales, biases), each (B, heads, length, width).
Triple = tuple[mx.array, mx.array, mx.array]


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels run here, and which; ``reason`` says why not."""

    available: bool
    isa: str = ""
    threads: int = 0
    reason: str = ""

    def describe(self) -> str:
        """One line for ``stats()``: the instruction set and threads, or why they are off."""
        if self.available:
            return f"{self.isa}, {self.threads} threads"
        return f"off: {self.reason}"


def _same_release(built: str, running: str) -> bool:
    """Whether two mlx versions share major.minor.patch (a dev suffix aside)."""
    return built.split(".")[:3] == running.split("+")[0].split(".")[:3]


def _self_test(ext: ModuleType) -> str:
    """Empty when a small product matches MLX's own op; else what went wrong."""
    w = mx.random.normal((16, 64), key=mx.random.key(7))
    x = mx.random.normal((3, 64), key=mx.random.key(8))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    ours = ext.quantized_matmul(x, wq, scales, biases, 32, 4)
    ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
    error = mx.abs(ours - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)
    value = float(cast(float, error.item()))
    return "" if value < 0.05 else f"self-test off by {value:.3g}"


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple[ModuleType | None, KernelStatus]:
    """The extension and its status, once per process."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, KernelStatus(False, reason=f"{ENV_SWITCH}=0")
    try:
        from engine.device.kernels import cpu_native as ext  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, KernelStatus(False, reason=f"extension not built or not loadable ({exc})")
    info: dict[str, Any] = ext.info()
    running = str(getattr(mx, "__version__", ""))
    if not _same_release(str(info["mlx_version"]), running):
        return None, KernelStatus(False, reason=f"built for mlx {info['mlx_version']}, "
                                                f"running {running}")
    try:
        with mx.stream(mx.cpu):
            failure = _self_test(ext)
    except Exception as exc:  # a broken build must cost speed, never correctness
        failure = f"self-test raised {type(exc).__name__}: {exc}"
    if failure:
        return None, KernelStatus(False, reason=failure)
    return ext, KernelStatus(True, isa=str(info["isa"]), threads=int(info["threads"]))


def kernel_status() -> KernelStatus:
    """Whether the kernels can run in this process (loads them the first time)."""
    return _loaded()[1]


def kernels_available() -> bool:
    """Whether the kernels load and pass their check here."""
    return kernel_status().available


def _ext() -> Any:
    ext = _loaded()[0]
    if ext is None:
        raise RuntimeError(f"CPU kernels unavailable: {kernel_status().reason}")
    return ext


def qmm_supported(bits: int, group_size: int, mode: str = "affine") -> bool:
    """Whether the matmul kernel takes weights quantized this way."""
    return mode == "affine" and bits in QMM_BITS and group_size in QMM_GROUPS


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int, int8: bool = False) -> mx.array:
    """``x @ dequantize(w).T`` (``mx.quantized_matmul(..., transpose=True)``), on the CPU;
    ``int8``: ``x`` rounded to int8 blocks of 32 where ``int8_path()`` names a path."""
    return _ext().quantized_matmul(x, w, scales, biases, group_size, bits, int8)  # type: ignore[no-any-return]


def quantized_matmul_many(x: mx.array, ws: list[mx.array], scales: list[mx.array],
                          biases: list[mx.array], group_size: int, bits: int,
                          int8: bool = False) -> list[mx.array]:
    """``quantized_matmul`` of one ``x`` against several weights of one layout, as one op:
    ``x`` staged once, one parallel pass over all their columns; each output has the bits
    ``quantized_matmul`` gives it alone."""
    return list(_ext().quantized_matmul_many(x, ws, scales, biases, group_size, bits, int8))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` as one op (float32): MLX's CPU backend runs it as ~7 ops."""
    return _ext().rms_norm(x, weight, eps)  # type: ignore[no-any-return]


def rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None) -> mx.array:
    """``mx.fast.rope`` as one op (float32 ``x`` of at least 3 axes): MLX's CPU backend runs
    it as ~20 ops. ``offset``: one position or one per batch row, as ``mx.fast.rope``."""
    if isinstance(offset, mx.array):
        offset = offset.astype(mx.int32) if offset.dtype != mx.int32 else offset
    else:
        offset = mx.array(offset, dtype=mx.int32)
    return _ext().rope(x, dims, traditional, 1.0 if base is None else base, scale,  # type: ignore[no-any-return]
                       offset, freqs)


def int8_path() -> str:
    """The int8-activation matmul this CPU runs (``"avx512-vnni"``), or ``""`` for none."""
    ext = _loaded()[0]
    return str(ext.info().get("int8", "")) if ext is not None else ""


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (mlx-lm's ``swiglu``) in one pass, vectorized and threaded."""
    return _ext().silu_mul(gate, up)  # type: ignore[no-any-return]


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              mask: mx.array | None = None, causal: bool = False) -> mx.array:
    """Fused attention of (B, Hq, L, D) queries over (B, Hkv, S, D) keys and values.

    ``mask``: boolean (True keeps a key) or additive float32, broadcastable to
    (B, Hq, L, S); ``causal``: key j is seen by query i when j <= i + S - L. Keys a mask
    drops are never read, so padding costs nothing and changes no result.
    """
    return _ext().attention(q, k, v, scale, mask, causal)  # type: ignore[no-any-return]


def quantized_attention_supported(queries: mx.array, keys: Triple, values: Triple,
                                  group_size: int, bits: int) -> bool:
    """Whether ``quantized_attention`` takes these shapes and dtypes (else mlx-lm's
    ``quantized_scaled_dot_product_attention`` should run)."""
    if bits not in QATTN_BITS or group_size not in QATTN_GROUPS or queries.ndim != 4:
        return False
    if len(keys) != 3 or len(values) != 3 or any(t.ndim != 4 for t in (*keys, *values)):
        return False
    floats = (mx.float32, mx.float16, mx.bfloat16)
    dim, value_dim = queries.shape[-1], values[0].shape[-1] * 32 // bits
    return (queries.dtype in floats and keys[1].dtype in floats
            and keys[0].dtype == values[0].dtype == mx.uint32
            and all(t.dtype == keys[1].dtype for t in (keys[2], values[1], values[2]))
            and keys[0].shape[-1] * 32 // bits == dim
            and max(dim, value_dim) <= ATTENTION_MAX_DIM
            and dim % group_size == 0 and value_dim % group_size == 0)


def quantized_attention(q: mx.array, keys: Triple, values: Triple, scale: float,
                        group_size: int, bits: int, mask: mx.array | None = None,
                        causal: bool = False) -> mx.array:
    """Fused attention of (B, Hq, L, D) queries over keys and values kept quantized:
    ``keys`` and ``values`` are ``mx.quantize(..., group_size, bits)``'s (packed uint32,
    scales, biases) along the head dimension, (B, Hkv, S, ·) each, as mlx-lm's quantized
    caches hand them out; never dequantized to a copy. What mlx-lm's
    ``quantized_scaled_dot_product_attention`` computes (``mask`` and ``causal`` as for
    ``attention``), in float32 with the output in ``q``'s dtype."""
    return _ext().quantized_attention(q, *keys, *values, scale, group_size, bits,  # type: ignore[no-any-return]
                                      mask, causal)


# One projection's (weight, scales, biases).
Projection = tuple[mx.array, mx.array, mx.array]


def decode_qkv(x: mx.array, norm_weight: mx.array, eps: float, qkv: list[Projection],
               group_size: int, bits: int, int8: bool, heads: int, kv_heads: int,
               rope_dims: int, traditional: bool, base: float, rope_scale: float,
               offset: mx.array, freqs: mx.array | None = None,
               qkv_bias: list[mx.array] | None = None, qk_norm: list[mx.array] | None = None,
               qk_eps: float = 0.0) -> list[mx.array]:
    """A decoder layer's first half at one query a row, as one op: RMSNorm of ``x``
    (float32 (B, 1, hidden)), the q/k/v products (plus ``qkv_bias``), an RMSNorm of each
    q and k head (``qk_norm``, ``qk_eps``) and RoPE of q and k at ``offset`` (int32, one or
    one a row); (q, k, v) as (B, heads, 1, D), with the bits of the separate ops."""
    return list(_ext().decode_qkv(x, norm_weight, eps, [p[0] for p in qkv],
                                  [p[1] for p in qkv], [p[2] for p in qkv], group_size, bits,
                                  int8, heads, kv_heads, rope_dims, traditional, base,
                                  rope_scale, offset, freqs, qkv_bias or [], qk_norm or [],
                                  qk_eps))


def decode_rest(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                mask: mx.array | None, causal: bool, x: mx.array, o_proj: Projection,
                o_quant: tuple[int, int], norm_weight: mx.array, eps: float,
                gate: Projection, up: Projection, gate_up_quant: tuple[int, int],
                down: Projection, down_quant: tuple[int, int], int8: bool) -> mx.array:
    """A decoder layer's second half at one query a row, as one op: ``attention`` of ``q``
    over the cache's ``keys`` and ``values``, the o product, the residual onto ``x``,
    RMSNorm, gate/up, SiLU, down and the residual; quantizations as (group_size, bits)."""
    return _ext().decode_rest(q, keys, values, scale, mask, causal, x, list(o_proj),  # type: ignore[no-any-return]
                              *o_quant, norm_weight, eps, list(gate), list(up), *gate_up_quant,
                              list(down), *down_quant, int8)


def read_through(a: mx.array) -> int:
    """Reads ``a``'s bytes (evaluated first) on the kernels' threads; a checksum. What a
    memory-bound kernel can stream at best: ``bench/cpu_kernels.py`` times it."""
    mx.eval(a)
    return int(_ext().read_through(a))
