"""Prefix reuse on an agent-shaped workload, cache on versus off in the same run.

16 parallel conversations share a ~1,000-token head (system prompt + tool schemas) and
differ in a short user tail; then each conversation takes a second turn. Reports the
mean time to first token (TTFT) and the wall time of each phase.

    python bench/prefix_reuse.py [--model PATH_OR_GGUF] [--rows 16] [--tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import (
    ChatRequest,
    Completion,
    Engine,
    EngineConfig,
    SamplingParams,
    TextRequest,
    blas_info,
)


def rules(n: int) -> str:
    return " ".join(f"Rule {i}: be precise about topic {i} and cite sources." for i in range(n))

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Look up fact family {i} in the knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "limit": {"type": "integer"}},
                   "required": ["query"]}}} for i in range(6)]
TOPICS = ["rivers", "volcanoes", "tea", "owls", "trains", "glass", "maps", "bees", "salt",
          "clocks", "kites", "moss", "bridges", "ink", "wolves", "comets"]


def turn_one(i: int, head: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are a research agent. {head}"},
            {"role": "user", "content": f"Tell me one fact about {TOPICS[i % 16]}."}]


def run_phase(eng: Engine, conversations: list[list[dict[str, str]]],
              tokens: int) -> tuple[list[Completion], float]:
    params = SamplingParams(max_tokens=tokens)
    start = time.perf_counter()
    handles = [eng.submit(ChatRequest.from_openai(c, params, tools=TOOLS))
               for c in conversations]
    results = [h.result() for h in handles]
    return results, time.perf_counter() - start


def workload(eng: Engine, rows: int, tokens: int, head: str) -> dict[str, float]:
    first_convs = [turn_one(i, head) for i in range(rows)]
    first, first_wall = run_phase(eng, first_convs, tokens)
    second_convs = [[*conv, {"role": "assistant", "content": r.content},
                     {"role": "user", "content": "Why is that?"}]
                    for conv, r in zip(first_convs, first)]
    second, second_wall = run_phase(eng, second_convs, tokens)
    ttft = [r.usage.time_to_first_token or 0.0 for r in first]
    ttft2 = [r.usage.time_to_first_token or 0.0 for r in second]
    return {"prompt": statistics.mean(r.usage.prompt_tokens for r in first),
            "ttft1": statistics.mean(ttft), "wall1": first_wall,
            "ttft2": statistics.mean(ttft2), "wall2": second_wall,
            "cached2": statistics.mean(r.usage.cached_tokens for r in second)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rules", type=int, default=60, help="head length knob (~15 tok each)")
    args = parser.parse_args()
    results = {}
    for label, cache_bytes in (("off", 0), ("on", 2 << 30)):
        config = EngineConfig(max_batch=args.rows, prefix_cache_bytes=cache_bytes)
        with Engine(args.model, config) as eng:
            eng.start()
            if label == "off":
                print(f"model: {eng.model_path}\nBLAS: {blas_info().name}")
            eng.submit(TextRequest("warm up", SamplingParams(max_tokens=2))).result()
            results[label] = workload(eng, args.rows, args.tokens, rules(args.rules))
            stats = eng.stats()
            results[label]["hits"] = stats.prefix_hits
    off, on = results["off"], results["on"]
    print(f"\n{args.rows} conversations, ~{off['prompt']:.0f}-token first prompts, "
          f"{args.tokens} new tokens per turn\n")
    print("| cache | turn 1 TTFT s | turn 1 wall s | turn 2 TTFT s | turn 2 wall s | "
          "turn 2 cached tokens | hits |")
    print("|------:|--------------:|--------------:|--------------:|--------------:|"
          "---------------------:|-----:|")
    for label in ("off", "on"):
        r = results[label]
        print(f"| {label} | {r['ttft1']:.2f} | {r['wall1']:.2f} | {r['ttft2']:.2f} | "
              f"{r['wall2']:.2f} | {r['cached2']:.0f} | {r['hits']:.0f} |")
    print(f"\nturn 2 TTFT, cache on / off: {on['ttft2'] / off['ttft2']:.3f}  (target <= 0.20)")
    print(f"turn 1 TTFT, cache on / off: {on['ttft1'] / off['ttft1']:.3f}")


if __name__ == "__main__":
    main()
