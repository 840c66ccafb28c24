"""float32 matmul GFLOP/s and decode tok/s on the reference BLAS vs the fast one, in one run.

The BLAS is chosen once per process (before mlx.core loads), so each side runs in its own
subprocess: the reference side with MLX_PROVIDERS_FAST_BLAS=0, each fast side with the
default search and OPENBLAS_NUM_THREADS as given by --threads.

    python bench/blas.py [--model PATH] [--rows 1,16] [--threads auto,1,2] [--repeat 3]
                         [--matmuls 16x2048x2048,2048x2048x2048] [--tokens 64]

PATH is an mlx-lm model directory (default: the default model's float32 conversion); a
float32 one shows BLAS best (mlx's CPU backend uses BLAS for float32 matmuls only). Decode
rate = tokens generated after every row's first token / time from that first token to the
last. Timings are best-of --repeat: other processes on the machine only ever make a run
slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

MATMULS = "16x2048x2048,2048x2048x2048"
PROMPT_TOKENS = 32


def load_blas_module() -> ModuleType:
    """engine._platform.blas. Importing ``engine`` activates the BLAS this process's
    environment asks for (MLX_PROVIDERS_FAST_BLAS=0: the reference one) before mlx loads."""
    import engine._platform.blas as blas

    return blas


def time_matmul(m: int, k: int, n: int, repeat: int) -> float:
    import mlx.core as mx

    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    # Warm up (thread pool, page faults) on 16 rows: one reference 2048^3 call takes seconds.
    mx.eval(a[:16] @ b)
    calls = max(1, int(0.2 / max(1e-4, 2 * m * k * n / 50e9)))  # ~0.2 s per sample when fast
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            mx.eval(a @ b)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def time_decode(model: Any, prompts: list[list[int]], repeat: int, max_tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator

    rows = len(prompts)
    best = 0.0
    for _ in range(repeat):
        # No stop tokens: every row decodes exactly max_tokens, whatever the weights say.
        gen = BatchGenerator(
            model, max_tokens=max_tokens, completion_batch_size=rows, prefill_batch_size=rows
        )
        gen.insert(prompts, max_tokens=[max_tokens] * rows)
        first = last = 0.0
        count = 0
        while count < max_tokens * rows:
            responses = gen.next_generated()
            now = time.perf_counter()
            if not first:
                first = now  # every row got its first token from the prefill step
            last = now
            count += len(responses)
        gen.close()
        best = max(best, (count - rows) / (last - first))
    return best


def worker(args: argparse.Namespace) -> None:
    blas = load_blas_module()
    blas.activate_fast_blas()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    mx.random.seed(0)
    info = blas.blas_info()
    binding = blas.mlx_blas_binding()
    result: dict[str, Any] = {
        "blas": info.name,
        "active": info.active,
        "threads": info.threads,
        "bound_to": binding.library if binding else None,
        "matmul_s": {f"{m}x{k}x{n}": time_matmul(m, k, n, args.repeat)
                     for m, k, n in args.matmuls},
    }
    model, tokenizer = load(args.model)
    params: Any = tree_flatten(model.parameters())
    dtypes = {str(p.dtype) for _, p in params}
    ids = list(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)) * 4
    result["model_dtypes"] = sorted(dtypes)
    result["decode_tok_s"] = {}
    for rows in args.rows:
        # Distinct prompts per row, PROMPT_TOKENS each.
        prompts = [ids[i : i + PROMPT_TOKENS] for i in range(rows)]
        result["decode_tok_s"][str(rows)] = time_decode(model, prompts, args.repeat,
                                                        args.tokens)
    print("RESULT " + json.dumps(result))


def run_side(args: argparse.Namespace, env_update: dict[str, str | None]) -> dict[str, Any]:
    env = dict(os.environ)
    for key, value in env_update.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        args.model,
        "--rows",
        ",".join(map(str, args.rows)),
        "--repeat",
        str(args.repeat),
        "--matmuls",
        ",".join("x".join(map(str, shape)) for shape in args.matmuls),
        "--tokens",
        str(args.tokens),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"worker failed ({env_update}):\n{out.stdout}\n{out.stderr}")
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def ratio(fast: float, ref: float) -> str:
    return f"{fast / ref:.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="mlx-lm model directory (default: the default model, float32)")
    parser.add_argument("--rows", default="1,16", help="decode batch sizes (default 1,16)")
    parser.add_argument(
        "--threads",
        default="auto",
        help="fast-side OPENBLAS_NUM_THREADS values; auto = blas.py default",
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of this many")
    parser.add_argument("--matmuls", default=MATMULS, help=f"MxKxN shapes (default {MATMULS})")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per row")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rows = [int(r) for r in str(args.rows).split(",")]
    args.matmuls = [tuple(int(x) for x in shape.split("x")) for shape in args.matmuls.split(",")]
    if args.model is None:  # resolved here, once: the workers must not convert it
        from engine import resolve_model

        args.model = str(resolve_model(None, quantized=False))
    if args.worker:
        worker(args)
        return

    no_threads: dict[str, str | None] = {
        "OPENBLAS_NUM_THREADS": None,
        "GOTO_NUM_THREADS": None,
        "OMP_NUM_THREADS": None,
    }
    load_before = os.getloadavg()[0]  # other processes skew timings; say how busy it was
    ref = run_side(args, {"MLX_PROVIDERS_FAST_BLAS": "0"})
    fasts: list[tuple[str, dict[str, Any]]] = []
    for t in args.threads.split(","):
        env = {**no_threads, "MLX_PROVIDERS_FAST_BLAS": None}
        if t != "auto":
            env["OPENBLAS_NUM_THREADS"] = t
        side = run_side(args, env)
        short = str(side["blas"]).split(" (")[0]
        fasts.append((f"{short}, {side['threads']} thr", side))

    header = ["metric", "reference"]
    for label, _ in fasts:
        header += [f"fast: {label}", "fast/ref"]
    rows: list[list[str]] = []
    for shape, secs in ref["matmul_s"].items():
        m, k, n = (int(x) for x in shape.split("x"))
        gflop = 2 * m * k * n / 1e9
        cells = [f"matmul {shape} f32 GFLOP/s (ms)", f"{gflop / secs:.1f} ({secs * 1e3:.1f})"]
        for _, side in fasts:
            f_secs = side["matmul_s"][shape]
            cells += [f"{gflop / f_secs:.1f} ({f_secs * 1e3:.1f})", ratio(secs, f_secs)]
        rows.append(cells)
    for n_rows, tok_s in ref["decode_tok_s"].items():
        cells = [f"decode tok/s, {n_rows} row(s)", f"{tok_s:.1f}"]
        for _, side in fasts:
            f_tok = side["decode_tok_s"][n_rows]
            cells += [f"{f_tok:.1f}", ratio(f_tok, tok_s)]
        rows.append(cells)

    print(
        f"model: {args.model} ({', '.join(ref['model_dtypes'])}); "
        f"{os.cpu_count()} CPUs; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    for side in [ref] + [side for _, side in fasts]:
        print(
            f"  {side['blas']}, {side['threads']} threads: libmlx cblas_sgemm -> {side['bound_to']}"
        )
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
