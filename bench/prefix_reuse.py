"""Prefix reuse on an agent-shaped workload, cache on versus off in the same run.

Part 1: 16 parallel conversations share a ~1,000-token head (system prompt + tool schemas)
and differ in a short user tail; then each conversation takes a second turn. Reports the
mean time to first token (TTFT) and the wall time of each phase.

Part 2 (``--kinds``): the same two turns at ``--kind-rows`` rows on ~100M-parameter
random-weight models of other cache kinds (``testkit.cache_kinds``: a sliding window,
hybrids, a state-space model; the default model's tokenizer): turn-2 TTFT on vs off, and
whether the answers are the same tokens.

Part 3 (``--restart``): a restart. One process answers a question under a ~2,000-token
agent head with ``EngineConfig(prefix_cache_dir=...)`` and exits; a second process, on the
same directory, answers another question under the same head (warm from disk), and a
third answers it with no directory (cold). Each is a fresh Python process; TTFT is that
request's, after a short warm-up request. The warm and cold answers must be the same
tokens. Run for the default model and every ``--kinds`` model.

    python bench/prefix_reuse.py [--model PATH_OR_GGUF] [--rows 16] [--tokens 16]
        [--kinds gemma3_text lfm2 granitemoehybrid] [--kind-rows 4]
        [--restart] [--restart-rules 90] [--restart-kinds gemma3_text] [--skip-turns]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for testkit.cache_kinds
import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import (
    ChatRequest,
    Completion,
    Engine,
    EngineConfig,
    SamplingParams,
    TextRequest,
    blas_info,
    resolve_model,
)
from testkit.cache_kinds import bench_model

BENCH_MODELS = Path.home() / ".cache" / "mlx-providers" / "bench-models"


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


def workload(eng: Engine, rows: int, tokens: int, head: str) -> dict[str, Any]:
    first_convs = [turn_one(i, head) for i in range(rows)]
    first, first_wall = run_phase(eng, first_convs, tokens)
    second_convs = [[*conv, {"role": "assistant", "content": r.content},
                     {"role": "user", "content": "Why is that?"}]
                    for conv, r in zip(first_convs, first)]
    second, second_wall = run_phase(eng, second_convs, tokens)
    ttft = [r.usage.time_to_first_token or 0.0 for r in first]
    ttft2 = [r.usage.time_to_first_token or 0.0 for r in second]
    return {"prompt": statistics.mean(r.usage.prompt_tokens for r in first),
            "prompt2": statistics.mean(r.usage.prompt_tokens for r in second),
            "ttft1": statistics.mean(ttft), "wall1": first_wall,
            "ttft2": statistics.mean(ttft2), "wall2": second_wall,
            "cached2": statistics.mean(r.usage.cached_tokens for r in second),
            "tokens": [r.token_ids for r in first + second]}


def on_off(model: str | None, rows: int, tokens: int, head: str) -> dict[str, dict[str, Any]]:
    """The two turns on an engine with the prefix store off, then one with it on."""
    results: dict[str, dict[str, Any]] = {}
    for label, cache_bytes in (("off", 0), ("on", 2 << 30)):
        config = EngineConfig(max_batch=rows, prefix_cache_bytes=cache_bytes)
        with Engine(model, config) as eng:
            eng.start()
            eng.submit(TextRequest("warm up", SamplingParams(max_tokens=2))).result()
            results[label] = workload(eng, rows, tokens, head)
            stats = eng.stats()
            results[label]["hits"] = stats.prefix_hits
            results[label]["kinds"] = ", ".join(stats.cache_kinds)
            results[label]["path"] = eng.model_path
    return results


def default_table(model: str | None, rows: int, tokens: int, head: str) -> None:
    results = on_off(model, rows, tokens, head)
    off, on = results["off"], results["on"]
    print(f"model: {off['path']}\nBLAS: {blas_info().name}")
    print(f"\n{rows} conversations, ~{off['prompt']:.0f}-token first prompts, "
          f"{tokens} new tokens per turn\n")
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
    print(f"same tokens on and off: {'yes' if on['tokens'] == off['tokens'] else 'NO'}")


def kinds_table(models: list[str], rows: int, tokens: int, head: str) -> None:
    print(f"\nturn 2 by cache kind: {rows} conversations, ~100M random models, "
          f"{tokens} new tokens per turn\n")
    print("| model | cache kinds | turn 2 prompt | turn 2 TTFT off s | turn 2 TTFT on s | "
          "on / off | turn 2 cached tokens | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for model in models:
        results = on_off(model, rows, tokens, head)
        off, on = results["off"], results["on"]
        same = "yes" if on["tokens"] == off["tokens"] else "NO"
        print(f"| {Path(model).name} | {on['kinds']} | {on['prompt2']:.0f} | "
              f"{off['ttft2']:.2f} | {on['ttft2']:.2f} | {on['ttft2'] / off['ttft2']:.3f} | "
              f"{on['cached2']:.0f} | {same} |", flush=True)


def restart_conversation(head: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are a research agent. {head}"},
            {"role": "user", "content": question}]


def restart_child(model: str, mode: str, directory: str, head_rules: int,
                  tokens: int) -> None:
    """One process of the restart measurement; prints its result as one JSON line.

    ``write``: the first run, on ``directory``; ``warm``: the restart, on the same
    directory; ``cold``: the same request as ``warm`` with no directory.
    """
    started = time.perf_counter()
    config = EngineConfig(prefix_cache_dir=None if mode == "cold" else directory)
    with Engine(model, config) as eng:
        eng.start()
        loaded = time.perf_counter() - started
        eng.submit(TextRequest("warm up", SamplingParams(max_tokens=2))).result()
        question = "Tell me one fact about owls." if mode == "write" else "What do bees eat?"
        request = ChatRequest.from_openai(restart_conversation(rules(head_rules), question),
                                          SamplingParams(max_tokens=tokens), tools=TOOLS)
        result = eng.submit(request).result()
        stats = eng.stats()
    print(json.dumps({"ttft": result.usage.time_to_first_token,
                      "prompt": result.usage.prompt_tokens,
                      "cached": result.usage.cached_tokens, "tokens": list(result.token_ids),
                      "disk_hits": stats.prefix_disk_hits,
                      "written": stats.prefix_disk_written, "load": loaded}))


def run_child(model: str, mode: str, directory: str, head_rules: int,
              tokens: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", model,
                          "--dir", directory, "--restart-rules", str(head_rules),
                          "--tokens", str(tokens)],
                         check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def restart_table(models: list[str], head_rules: int, tokens: int) -> None:
    print(f"\nrestart: a new process, the same agent head, {tokens} new tokens; "
          "TTFT warm from disk (prefix_cache_dir) vs cold\n")
    print("| model | prompt tokens | first process TTFT s | entries written | cold TTFT s | "
          "warm TTFT s | warm / cold | read from disk | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for model in models:
        with tempfile.TemporaryDirectory(prefix="prefix-disk-") as directory:
            first = run_child(model, "write", directory, head_rules, tokens)
            warm = run_child(model, "warm", directory, head_rules, tokens)
            cold = run_child(model, "cold", directory, head_rules, tokens)
        same = "yes" if warm["tokens"] == cold["tokens"] else "NO"
        print(f"| {Path(model).name} | {warm['prompt']} | {first['ttft']:.2f} | "
              f"{first['written']} | {cold['ttft']:.2f} | {warm['ttft']:.2f} | "
              f"{warm['ttft'] / cold['ttft']:.3f} | {warm['cached']} | {same} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rules", type=int, default=60, help="head length knob (~15 tok each)")
    parser.add_argument("--kinds", nargs="*", default=[],
                        help="also ~100M random models of these mlx-lm types")
    parser.add_argument("--kind-rows", type=int, default=4)
    parser.add_argument("--restart", action="store_true", help="measure a restart (part 3)")
    parser.add_argument("--restart-kinds", nargs="*", default=None,
                        help="the --kinds models part 3 runs on (default: all of them)")
    parser.add_argument("--restart-rules", type=int, default=90,
                        help="restart head length knob (90: ~2,000 tokens with the tools)")
    parser.add_argument("--skip-turns", action="store_true", help="skip part 1")
    parser.add_argument("--child", choices=["write", "warm", "cold"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        restart_child(args.model, args.child, args.dir, args.restart_rules, args.tokens)
        return
    if not args.skip_turns:
        default_table(args.model, args.rows, args.tokens, rules(args.rules))
    default = str(resolve_model(args.model))
    kind_models = [str(bench_model(kind, Path(default), BENCH_MODELS)) for kind in args.kinds]
    if kind_models:
        kinds_table(kind_models, args.kind_rows, args.tokens, rules(args.rules))
    if args.restart:
        chosen = args.kinds if args.restart_kinds is None else args.restart_kinds
        restart_models = [str(bench_model(kind, Path(default), BENCH_MODELS))
                          for kind in chosen]
        restart_table([default, *restart_models], args.restart_rules, args.tokens)


if __name__ == "__main__":
    main()
