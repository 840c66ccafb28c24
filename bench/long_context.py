"""Long shared contexts: 16 concurrent questions over one long system context.

Parallel tool branches and query engines share a long conversation or document. This bench
sends ``--rows`` short questions at once, each behind the same ~``--context``-token system
context, for ``--tokens`` tokens each, three rounds: cold (nothing cached), warm (the context
already in the prefix store), and short (the same questions without the context). It prints
the mean time to first token per round, the mean decode-step time while every row decodes,
and the bounds the issue sets: cold mean TTFT against one prefill of the context plus the
questions, and the long decode step against the short one.

    python bench/long_context.py [--rows 16] [--tokens 24] [--context 886] [--kv-bits 8]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    SamplingParams,
    StepProbe,
    TextRequest,
    TurnReport,
    blas_info,
)

QUESTIONS = ["rivers", "volcanoes", "tea", "owls", "trains", "glass", "maps", "bees", "salt",
             "clocks", "kites", "moss", "bridges", "ink", "wolves", "comets"]


def context_text(tokens: int) -> str:
    """A document of roughly ``tokens`` tokens (about 28 tokens a sentence)."""
    sentences = [f"Section {i}: the archive records that item {i} was catalogued in "
                 f"year {1900 + i} by the northern office." for i in range(tokens // 28)]
    return "You answer questions about this archive.\n" + " ".join(sentences)


class StepTimer:
    """Records each turn's lane-step seconds while every row is decoding."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.full: list[float] = []
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, report: TurnReport) -> None:
        stats = report.stats
        spent, self._last = stats.step_seconds - self._last, stats.step_seconds
        if stats.running == self.rows and stats.pending == 0 and not report.admitted:
            with self._lock:
                self.full.append(spent)

    def take(self) -> list[float]:
        with self._lock:
            full, self.full = self.full, []
        return full


def run_round(eng: Engine, timer: StepTimer, system: str | None,
              rows: int, tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    convs = []
    for i in range(rows):
        conv = [{"role": "user", "content": f"Tell me one fact about {QUESTIONS[i % 16]}."}]
        if system is not None:
            conv.insert(0, {"role": "system", "content": system})
        convs.append(conv)
    timer.take()
    start = time.perf_counter()
    handles = [eng.submit(ChatRequest.from_openai(c, params)) for c in convs]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    steps = timer.take()
    ttfts = sorted(r.usage.time_to_first_token or 0.0 for r in results)
    return {"prompt": statistics.mean(r.usage.prompt_tokens for r in results),
            "cached": statistics.mean(r.usage.cached_tokens for r in results),
            "ttft": statistics.mean(ttfts), "ttft_min": ttfts[0], "ttft_max": ttfts[-1],
            "wall": wall, "step": statistics.median(steps) if steps else float("nan"),
            "steps": len(steps)}


def prefill_bound(eng: Engine, system: str, rows: int) -> float:
    """Seconds for one request that prefills the context plus every question, one token out."""
    questions = " ".join(f"Tell me one fact about {QUESTIONS[i % 16]}." for i in range(rows))
    conv = [{"role": "system", "content": system}, {"role": "user", "content": questions}]
    start = time.perf_counter()
    eng.submit(ChatRequest.from_openai(conv, SamplingParams(max_tokens=1))).result()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--context", type=int, default=886, help="system context, ~tokens")
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                        help="keep the KV quantized (EngineConfig.kv_bits)")
    parser.add_argument("--kv-dtype", choices=("float16",), default=None,
                        help="keep the KV in float16 (EngineConfig.kv_dtype)")
    args = parser.parse_args()
    system = context_text(args.context)
    timer = StepTimer(args.rows)
    config = EngineConfig(max_batch=args.rows, kv_bits=args.kv_bits, kv_dtype=args.kv_dtype)
    with Engine(args.model, config, probe=StepProbe(on_turn=timer)) as eng:
        eng.start()
        print(f"model: {eng.model_path}\nBLAS: {blas_info().name}\n"
              f"KV: {eng.stats().cache_kinds}, {eng.stats().kv_bytes_per_token} bytes a token")
        eng.submit(TextRequest("warm up", SamplingParams(max_tokens=2))).result()
        short = run_round(eng, timer, None, args.rows, args.tokens)
        cold = run_round(eng, timer, system, args.rows, args.tokens)
        warm = run_round(eng, timer, system, args.rows, args.tokens)
        short2 = run_round(eng, timer, None, args.rows, args.tokens)
    # Short rounds before and after the long ones: the step bound is the faster of the two.
    short_step = min(short["step"], short2["step"])
    # The bound runs on a fresh engine, so nothing of the context is cached.
    with Engine(args.model, config) as eng:
        eng.start()
        eng.submit(TextRequest("warm up", SamplingParams(max_tokens=2))).result()
        bound = prefill_bound(eng, system, args.rows)
    print(f"\n{args.rows} rows, {args.tokens} tokens each, context ~{cold['prompt']:.0f} "
          f"prompt tokens a row\n")
    print("| round | prompt tok | cached tok | mean TTFT s | first / last TTFT s | wall s | "
          "decode step ms (n) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in (("short", short), ("long, cold", cold), ("long, warm", warm),
                    ("short, again", short2)):
        print(f"| {name} | {r['prompt']:.0f} | {r['cached']:.0f} | {r['ttft']:.2f} | "
              f"{r['ttft_min']:.2f} / {r['ttft_max']:.2f} | {r['wall']:.2f} | "
              f"{r['step'] * 1000:.0f} ({r['steps']}) |")
    print(f"\none prefill of the context + {args.rows} questions: {bound:.2f} s")
    print(f"cold mean TTFT / that bound: {cold['ttft'] / bound:.2f}  (goal <= 1.3)")
    print(f"long decode step / short: {cold['step'] / short_step:.2f} cold, "
          f"{warm['step'] / short_step:.2f} warm  (goal <= 1.5)")


if __name__ == "__main__":
    main()
