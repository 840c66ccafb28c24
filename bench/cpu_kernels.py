"""The CPU kernels' ops against MLX's own, and against the memory-bandwidth bound.

For each weight shape of the default model (SmolLM2-135M: N x K of its projections and its
tied output head) and a few row counts: the kernel's quantized matmul (4-bit, groups of 32,
float32 scales: the default model's layout on the CPU), MLX's float32 matmul through BLAS
(the engine's CPU path before the kernels) and MLX's own ``quantized_matmul``. Weights are
rotated over enough copies to outgrow the caches, so each call reads them from memory as a
decode step does. The bound is the call's bytes (weights, scales, biases) over the bandwidth
measured here by reading a 512 MB array on the kernels' threads. Then the fused attention
of a decode step (16 rows, 9 query heads over 3 KV heads, 64-wide) at a short and a long
context, against ``mx.fast.scaled_dot_product_attention``; the int8-activation path
(``EngineConfig.cpu_int8``) against the float path; RMSNorm and RoPE as one op each against
MLX's CPU fallbacks (``x + i`` in each: the add is timed on both sides).

    python bench/cpu_kernels.py [--repeats 30]

Medians of ``--repeats`` calls; the machine is shared, so read ratios, not single times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import engine  # noqa: F401 - the fast BLAS before mlx (else MLX's float32 runs slow)
from engine.device.kernels import cpu_kernels

# isort: split
import mlx.core as mx

SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (192, 576),
          "gate/up_proj": (1536, 576), "down_proj": (576, 1536), "lm_head (tied)": (49152, 576)}
ROWS = (1, 4, 16, 64)
CACHE_OUTGROWN = 160 * 2**20  # copies of a weight until they outgrow L2 + L3 twice over


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` (evaluated) in ms, after one warm-up."""
    mx.eval(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(call())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bandwidth() -> float:
    """Bytes/s the kernels' threads read from memory (a 512 MB array, best of 5)."""
    big = mx.zeros((2**27,), dtype=mx.float32)
    mx.eval(big)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        cpu_kernels.read_through(big)
        best = min(best, time.perf_counter() - start)
    return big.nbytes / best


class Rotation:
    """Copies of one weight, handed out in turn so that none is still in cache."""

    def __init__(self, n: int, k: int) -> None:
        one = mx.random.normal((n, k))
        q = mx.quantize(one, group_size=32, bits=4)
        per_copy = n * k * 4
        self.count = max(1, min(64, CACHE_OUTGROWN // per_copy))
        self.dense = [one + i for i in range(self.count)]
        self.quant = [tuple(a + 0 if a.dtype != mx.uint32 else a for a in q) for _ in
                      range(max(1, min(64, CACHE_OUTGROWN // (n * k // 2))))]
        mx.eval(self.dense, self.quant)
        self.i = 0
        self.qbytes = sum(a.nbytes for a in q)

    def next_dense(self) -> mx.array:
        self.i += 1
        return self.dense[self.i % len(self.dense)]

    def next_quant(self) -> tuple[mx.array, mx.array, mx.array]:
        self.i += 1
        w, s, b = self.quant[self.i % len(self.quant)]
        return w, s, b


def matmul_table(repeats: int, bytes_per_s: float) -> None:
    print("| weight (N x K) | rows | kernel ms | MLX f32 ms | MLX q4 ms | vs f32 | vs MLX q4 "
          "| bound ms | kernel / bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        rot = Rotation(n, k)
        for m in ROWS:
            x = mx.random.normal((m, k))
            mx.eval(x)

            def ours(x: mx.array = x, rot: Rotation = rot) -> mx.array:
                w, s, b = rot.next_quant()
                return cpu_kernels.quantized_matmul(x, w, s, b, 32, 4)

            def mlx_q4(x: mx.array = x, rot: Rotation = rot) -> mx.array:
                w, s, b = rot.next_quant()
                return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)

            def f32(x: mx.array = x, rot: Rotation = rot) -> mx.array:
                return x @ rot.next_dense().T

            t_ours = median_ms(ours, repeats)
            t_f32 = median_ms(f32, repeats)
            t_q4 = median_ms(mlx_q4, max(3, repeats // 5))  # slow: fewer calls
            bound = 1000 * rot.qbytes / bytes_per_s
            print(f"| {name} {n} x {k} | {m} | {t_ours:.3f} | {t_f32:.3f} | {t_q4:.3f} "
                  f"| {t_f32 / t_ours:.1f}x | {t_q4 / t_ours:.1f}x | {bound:.3f} "
                  f"| {t_ours / bound:.2f} |", flush=True)


def attention_table(repeats: int, bytes_per_s: float) -> None:
    print("\n| decode attention (16 rows, 9/3 heads, 64 wide) | keys | kernel ms | MLX sdpa ms "
          "| vs MLX | bound ms (K+V bytes) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows, heads, kv_heads, dim = 16, 9, 3, 64
    for keys in (64, 900):
        pad = mx.array([i * 7 for i in range(rows)])
        mask = mx.expand_dims(pad, (1, 2, 3)) <= mx.arange(keys)[None, None, None]
        q = mx.random.normal((rows, heads, 1, dim))
        k = mx.random.normal((rows, kv_heads, keys, dim))
        v = mx.random.normal((rows, kv_heads, keys, dim))
        mx.eval(q, k, v, mask)
        qkv = (q, k, v)
        t_ours = median_ms(lambda qkv=qkv, mask=mask: cpu_kernels.attention(
            *qkv, 0.125, mask), repeats)
        t_mlx = median_ms(lambda qkv=qkv, mask=mask: mx.fast.scaled_dot_product_attention(
            *qkv, scale=0.125, mask=mask), repeats)
        bound = 1000 * (k.nbytes + v.nbytes) / bytes_per_s
        print(f"| one layer | {keys} | {t_ours:.3f} | {t_mlx:.3f} | {t_mlx / t_ours:.1f}x "
              f"| {bound:.3f} |", flush=True)


def many_in_one(calls: Callable[[], list[mx.array]], copies: int, repeats: int) -> float:
    """Median µs a call of ``copies`` independent calls evaluated together (no Python
    between them: the kernel's own time, dispatch included)."""
    mx.eval(calls())
    times = []
    for _ in range(repeats):
        outs = calls()
        start = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - start) / copies)
    return 1e6 * statistics.median(times)


def int8_table(repeats: int) -> None:
    """The int8-activation path (EngineConfig.cpu_int8) against the float path, per call."""
    path = cpu_kernels.int8_path()
    if not path:
        print("\nno int8-activation path on this CPU (it needs AVX-512 VNNI)")
        return
    print(f"\n| weight (N x K, bits) | rows | float path us | int8 path ({path}) us | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        bits = 8 if name.startswith("lm_head") else 4
        copies = max(1, min(40, 200_000_000 // (n * k)))
        weights = [mx.quantize(mx.random.normal((n, k)), group_size=32, bits=bits)
                   for _ in range(copies)]
        mx.eval(weights)
        for m in (1, 16):
            x = mx.random.normal((m, k))
            mx.eval(x)
            took = {}
            for int8 in (False, True):
                took[int8] = many_in_one(
                    lambda x=x, int8=int8, weights=weights, bits=bits: [
                        cpu_kernels.quantized_matmul(x, *w, 32, bits, int8) for w in weights],
                    copies, max(3, repeats // 4))
            print(f"| {name} {n} x {k}, {bits} | {m} | {took[False]:.1f} | {took[True]:.1f} "
                  f"| {took[False] / took[True]:.2f}x |", flush=True)


def norm_rope_table(repeats: int) -> None:
    """RMSNorm and RoPE as one kernel op against MLX's CPU fallbacks (~7 and ~20 ops)."""
    print("\n| op (one decode row, the default model's shapes) | kernel us | MLX us | vs MLX |")
    print("|---|---:|---:|---:|")
    x = mx.random.normal((1, 1, 576))
    w = mx.random.normal((576,))
    q = mx.random.normal((1, 9, 1, 64))
    offset = mx.array([70], dtype=mx.int32)
    copies = 60
    cases = {
        "rms_norm (1 x 576)": (lambda: [cpu_kernels.rms_norm(x + i, w, 1e-5)
                                        for i in range(copies)],
                               lambda: [mx.fast.rms_norm(x + i, w, 1e-5) for i in range(copies)]),
        "rope (9 heads x 64)": (lambda: [cpu_kernels.rope(q + i, 64, False, 100000.0, 1.0, offset)
                                         for i in range(copies)],
                                lambda: [mx.fast.rope(q + i, 64, traditional=False, base=100000.0,
                                                      scale=1.0, offset=offset)
                                         for i in range(copies)]),
    }
    for name, (ours, theirs) in cases.items():
        t_ours = many_in_one(ours, copies, repeats)
        t_mlx = many_in_one(theirs, copies, repeats)
        print(f"| {name} | {t_ours:.1f} | {t_mlx:.1f} | {t_mlx / t_ours:.1f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    status = cpu_kernels.kernel_status()
    if not status.available:
        raise SystemExit(f"the CPU kernels are not available here: {status.reason}")
    bytes_per_s = bandwidth()
    print(f"kernels: {status.describe()}; memory read bandwidth on their threads: "
          f"{bytes_per_s / 1e9:.1f} GB/s\n")
    with mx.stream(mx.cpu):
        matmul_table(args.repeats, bytes_per_s)
        attention_table(args.repeats, bytes_per_s)
        int8_table(args.repeats)
        norm_rope_table(args.repeats)


if __name__ == "__main__":
    main()
