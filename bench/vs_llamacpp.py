"""The engine against llama.cpp on the same GGUF file, on this CPU, ratios from one run.

llama.cpp is built once from the llama-cpp-python sdist's vendored source into a cache
directory (``bench/llamacpp_build.py``: ``-DGGML_NATIVE=ON``, ~15 min on 2 cores). Then:

1. decode tokens/s at 1-32 rows: ``llama-batched-bench -npp 64 -ntg 64 -t THREADS`` against
   the engine on the same file (64-token prompts, 64 tokens a row, all rows prefilled
   together, decode rate = tokens / (last token time - first token time)), the engine with
   its CPU kernels and, as "before", with ``MLX_PROVIDERS_CPU_KERNELS=0`` (float32 weights
   through BLAS), and with ``cpu_int8=True`` (activations rounded to int8 blocks of 32, as
   llama.cpp rounds them for its Q4_1 x Q8_1 products; where the CPU has the int8 path),
   and with its layers op by op (``MLX_PROVIDERS_DECODE_LAYER=0``: no two-op decode step);
   speculation off unless ``--speculation`` (llama-batched-bench decodes plainly); each
   side runs in its own process, in turn, ``--repeats`` times, best kept;
2. the servers: ``llama-server -np STREAMS`` against ``mlx-providers serve``, each driven by
   ``--streams`` concurrent openai-SDK streams of ``--tokens`` tokens (aggregate tokens/s,
   mean time to first token).

    python bench/vs_llamacpp.py [--gguf FILE] [--rows 1,4,8,16,32] [--threads 2]
        [--repeats 2] [--streams 16] [--tokens 64] [--skip-server] [--skip-before]
        [--skip-int8] [--skip-by-op] [--speculation N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Sibling scripts, not packages: the build, our server's launcher, the SDK fan-out.
from langchain_vs_server import HOST, ServerError, _free_port, _log_tail, _stop
from llamacpp_build import llamacpp_bin
from server_vs_mlx_lm import our_server, sdk_fan_out

STARTUP_TIMEOUT_S = 180.0
SERVER_PROMPT = "Write a short poem about {topic}."
TOPICS = ["the sea", "a robot", "tea", "mountains", "a city at night", "an old clock", "rain",
          "a library", "the moon", "bread", "a violin", "snow", "a garden", "trains",
          "a lighthouse", "autumn"]
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an "
         "old clockmaker who had repaired every clock in the valley for fifty years. One "
         "winter morning a stranger arrived with a broken pocket watch that ticked backwards, "
         "and asked whether it could be made to run forwards again before the spring came.")


# ---- llama.cpp -------------------------------------------------------------------------------


def llama_batched(bin_dir: Path, gguf: Path, rows: list[int], threads: int) -> dict[int, float]:
    """Decode tokens/s per row count (llama-batched-bench's S_TG column)."""
    command = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-npp", "64", "-ntg",
               "64", "-npl", ",".join(map(str, rows)), "-t", str(threads), "-tb", str(threads),
               "-c", str(max(rows) * 128 + 256)]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    rates: dict[int, float] = {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == "64" and cells[2].isdigit():
            rates[int(cells[2])] = float(cells[7])  # PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG
    missing = set(rows) - set(rates)
    if missing:
        raise RuntimeError(f"llama-batched-bench gave no rate for {sorted(missing)}:\n"
                           f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return rates


@contextlib.contextmanager
def llama_server(bin_dir: Path, gguf: Path, streams: int, threads: int) -> Iterator[str]:
    """``llama-server -np streams`` on a free loopback port; its base URL."""
    port = _free_port()
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", HOST, "--port",
               str(port), "-np", str(streams), "-c", str(streams * 512), "-t", str(threads),
               "-tb", str(threads)]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if process.poll() is not None:
                    raise ServerError("llama-server exited; its log ends:\n" + _log_tail(log))
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://{HOST}:{port}/health", timeout=5,
                                 trust_env=False).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerError("llama-server did not become healthy:\n" + _log_tail(log))
                time.sleep(0.25)
            yield f"http://{HOST}:{port}/v1"
        finally:
            _stop(process)


# ---- the engine (run in a child process: one per side, kernels on or off) --------------------


def engine_rates(gguf: str, rows: list[int], tokens: int, int8: bool,
                 speculation: int = 0) -> dict[int, float]:
    """Decode tokens/s per row count through ``Engine`` on the GGUF file (this process)."""
    import engine  # noqa: F401 - the fast BLAS before mlx
    from engine import Engine, EngineConfig, SamplingParams, TextRequest

    width = max(rows)
    eng = Engine(gguf, EngineConfig(max_batch=width, prefill_batch=width, cpu_int8=int8,
                                    speculation=speculation)).start()
    story = list(eng.tokenizer.encode(STORY, add_special_tokens=False))
    rates: dict[int, float] = {}
    for run, n in enumerate([2, *rows]):  # the first, 2 rows, warms up
        prompts = []
        for i in range(n):  # 64 tokens each, distinct from the first: no prefix reuse
            head = list(eng.tokenizer.encode(f"Story {run}.{i}: ", add_special_tokens=False))
            prompts.append((head + story)[:64])
        stamps: list[float] = []

        def on_token(_t: int, _d: str, stamps: list[float] = stamps) -> None:
            stamps.append(time.perf_counter())  # one list.append: atomic in CPython

        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for handle in [eng.submit(TextRequest(p, params), on_token=on_token)
                       for p in prompts]:
            handle.result()
        if run:
            rates[n] = len(stamps) / (max(stamps) - min(stamps))
    stats = eng.stats()
    print(json.dumps({"rates": rates, "weights": stats.weight_format,
                      "kernels": stats.cpu_kernels}))
    eng.close()
    return rates


def engine_side(gguf: Path, rows: list[int], tokens: int, kernels: bool,
                int8: bool = False, speculation: int = 0,
                by_op: bool = False) -> dict[str, object]:
    """One engine process's rates; ``by_op``: layers op by op (no two-op decode step)."""
    env = dict(os.environ)
    if not kernels:
        env["MLX_PROVIDERS_CPU_KERNELS"] = "0"
    if by_op:
        env["MLX_PROVIDERS_DECODE_LAYER"] = "0"
    run = subprocess.run([sys.executable, __file__, "--engine-child", str(gguf), "--rows",
                          ",".join(map(str, rows)), "--tokens", str(tokens),
                          "--speculation", str(speculation), *(["--int8"] if int8 else [])],
                         capture_output=True, text=True, env=env, check=True)
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    result["rates"] = {int(k): v for k, v in dict(result["rates"]).items()}  # type: ignore[call-overload]
    return result


# ---- the report ------------------------------------------------------------------------------


def best(runs: list[dict[int, float]]) -> dict[int, float]:
    return {n: max(r[n] for r in runs) for n in runs[0]}


def decode_table(args: argparse.Namespace, bin_dir: Path, gguf: Path, rows: list[int]) -> None:
    peer: list[dict[int, float]] = []
    after: list[dict[int, float]] = []
    before: list[dict[int, float]] = []
    by_op: list[dict[int, float]] = []
    rounded: list[dict[int, float]] = []
    info: dict[str, object] = {}
    int8_info: dict[str, object] = {}
    for _ in range(args.repeats):  # in turn, so a slower stretch of the machine hits all
        peer.append(llama_batched(bin_dir, gguf, rows, args.threads))
        info = engine_side(gguf, rows, 64, kernels=True, speculation=args.speculation)
        after.append(info["rates"])  # type: ignore[arg-type]
        if not args.skip_by_op:
            by_op.append(engine_side(gguf, rows, 64, kernels=True, speculation=args.speculation,
                                     by_op=True)["rates"])  # type: ignore[arg-type]
        if not args.skip_before:
            before.append(engine_side(gguf, rows, 64, kernels=False,
                                      speculation=args.speculation)["rates"])  # type: ignore[arg-type]
        if not args.skip_int8:
            int8_info = engine_side(gguf, rows, 64, kernels=True, int8=True,
                                    speculation=args.speculation)
            rounded.append(int8_info["rates"])  # type: ignore[arg-type]
    print(f"engine: weights {info['weights']}; CPU kernels {info['kernels']}")
    if int8_info:
        print(f"engine int8: CPU kernels {int8_info['kernels']}")
    print(f"llama.cpp: {args.threads} threads, llama-batched-bench -npp 64 -ntg 64")
    print(f"engine: speculation={args.speculation} (llama-batched-bench decodes plainly)\n")
    peer_best, after_best = best(peer), best(after)
    columns = {"engine before (f32, MLX ops)": best(before) if before else {},
               "engine, layers op by op": best(by_op) if by_op else {},
               "engine (kernels)": after_best,
               "engine cpu_int8": best(rounded) if rounded else {}}
    shown = {name: rates for name, rates in columns.items() if rates}
    print("| rows | llama.cpp tok/s | " + " | ".join(shown) + " | "
          + " | ".join(f"{name} / llama.cpp" for name in shown) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(shown)))
    for n in rows:
        print(f"| {n} | {peer_best[n]:.1f} | "
              + " | ".join(f"{rates[n]:.1f}" for rates in shown.values()) + " | "
              + " | ".join(f"{rates[n] / peer_best[n]:.2f}" for rates in shown.values())
              + " |", flush=True)


def server_table(args: argparse.Namespace, bin_dir: Path, gguf: Path) -> None:
    prompts = [SERVER_PROMPT.format(topic=TOPICS[i % len(TOPICS)]) + f" ({i})"
               for i in range(args.streams)]
    sides = []
    with llama_server(bin_dir, gguf, args.streams, args.threads) as url:
        sides.append(asyncio.run(sdk_fan_out(f"llama-server -np {args.streams}", url,
                                             "gguf", prompts, args.tokens)))
    with our_server(str(gguf), max_batch=max(32, args.streams), prefill_batch=args.streams,
                    max_tokens=args.tokens) as url:
        sides.append(asyncio.run(sdk_fan_out("mlx-providers serve", url, str(gguf), prompts,
                                             args.tokens)))
    print(f"\n{args.streams} openai-SDK streams, max_tokens {args.tokens}, temperature 0\n")
    print("| server | tokens | wall s | tok/s | mean TTFT s |")
    print("|---|---:|---:|---:|---:|")
    for side in sides:
        print(f"| {side.name} | {side.tokens} | {side.seconds:.2f} | {side.rate:.1f} "
              f"| {side.mean_ttft:.3f} |")
    peer, ours = sides
    print(f"\nmlx-providers / llama-server: throughput {ours.rate / peer.rate:.2f}x (goal >= "
          f"1.0x), mean TTFT {ours.mean_ttft / peer.mean_ttft:.2f}x (goal <= 1.0x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-before", action="store_true",
                        help="do not run the engine without its kernels")
    parser.add_argument("--skip-int8", action="store_true",
                        help="do not run the engine with cpu_int8=True (int8 activations)")
    parser.add_argument("--skip-by-op", action="store_true",
                        help="do not run the engine with its layers op by op "
                             "(MLX_PROVIDERS_DECODE_LAYER=0)")
    parser.add_argument("--speculation", type=int, default=0,
                        help="the engine's EngineConfig.speculation (default 0: plain decoding, "
                             "as llama-batched-bench's; the engine's own default is 1)")
    parser.add_argument("--int8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.engine_child:
        engine_rates(args.engine_child, rows, args.tokens, args.int8, args.speculation)
        return
    from engine.models.default_model import default_model_gguf

    gguf = Path(args.gguf) if args.gguf else default_model_gguf()
    bin_dir = llamacpp_bin()
    print(f"model: {gguf}\nload average: {os.getloadavg()[0]:.2f}")
    decode_table(args, bin_dir, gguf, rows)
    if not args.skip_server:
        server_table(args, bin_dir, gguf)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
