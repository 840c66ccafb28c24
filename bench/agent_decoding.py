"""What agents decode: grammar fast-forward on vs off, and speculation on vs off.

Part 1, forced tool calls and schema answers: two engines on the same model in one
process, ``fast_forward=True`` (the default) and ``False``, run the same loads in
alternation (best of ``--repeats``). A load is ``rows`` concurrent requests, each about
its own city, submitted at once; wall time runs from the first submit to the last result.
Steps are the engine's lane steps over the load; forced tokens are those the grammar
dictated.

Part 2, prompt-lookup speculation: an engine with ``speculation=--spec-rows`` against one
with it off, on greedy loads (an answer quoting its RAG context, a code edit, free prose,
and a forced tool call with parallel calls allowed, whose second call repeats the first)
at ``--spec-load-rows`` concurrent rows; the answers must be identical.

``--fresh``: part 1 from a fresh process, as a user's first agent batch meets it. Each run is
its own process (``fast_forward`` on and off alternating): the model loads, and the first
load is the first request the engine ever sees; nothing is measured before it.

Part 3, what a speculation check costs on each cache kind: a row's forward of one token
(a decode step) against seven (a check: the last token and a six-token draft), on its own
cache after a 500-token prompt, alternating, median of ``--check-repeats``; state caches
include taking their state back (``Rollback``) as a rejected draft does.

``--kinds`` runs parts 1 and 3 (and 2 with ``--kinds-spec``) on ~100M-parameter random-weight
models of other cache kinds as well (``testkit.cache_kinds``: a sliding window,
hybrids, a state-space model) with the default model's tokenizer; random weights time
like trained ones, though their drafts are never right.

    python bench/agent_decoding.py [--model PATH_OR_GGUF] [--rows 1 4 8 16] [--repeats 2]
        [--spec-rows 1] [--spec-load-rows 1 2 4] [--skip-ff] [--skip-spec]
        [--kinds gemma3_text lfm2] [--kinds-spec] [--check-repeats 9] [--short]
        [--fresh]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for testkit.cache_kinds
import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    JsonSchema,
    SamplingParams,
    blas_info,
    resolve_model,
)
from testkit.cache_kinds import bench_model

BENCH_MODELS = Path.home() / ".cache" / "mlx-providers" / "bench-models"

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul",
          "Dakar", "Perth", "Hanoi", "Bern", "Doha", "Riga", "Kyiv"]
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TRIP = JsonSchema({"type": "object", "properties": {
    "destination": {"type": "string"}, "days": {"type": "integer"},
    "season": {"type": "string", "enum": ["spring", "summer", "autumn", "winter"]}},
    "required": ["destination", "days", "season"]})
# Random weights never end a string by themselves: on the --kinds models the loads bound
# their free strings (12 characters) and numbers, so a call has a real call's length.
WEATHER_SHORT = {"type": "function", "function": {
    **WEATHER["function"], "parameters": {**WEATHER["function"]["parameters"], "properties": {
        **WEATHER["function"]["parameters"]["properties"],
        "city": {"type": "string", "description": "The city", "maxLength": 12}}}}}
TRIP_SHORT = JsonSchema({"type": "object", "properties": {
    "destination": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 30},
    "season": {"type": "string", "enum": ["spring", "summer", "autumn", "winter"]}},
    "required": ["destination", "days", "season"]})


@dataclass
class Run:
    wall: float
    tokens: int
    forced: int
    steps: int
    sample: str

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


def load(eng: Engine, kind: str, rows: int, parallel: bool = False,
         short: bool = False) -> Run:
    """``rows`` requests of ``kind`` ("tool": a forced call, "schema": a Trip answer) at
    once; ``short``: the bounded tool and schema (random-weight models)."""
    before = eng.stats()
    started = time.perf_counter()
    handles = []
    for i in range(rows):
        city = CITIES[i % len(CITIES)]
        if kind == "tool":
            messages = [{"role": "user", "content": f"What is the weather in {city} in celsius?"}]
            handles.append(eng.submit(ChatRequest.from_openai(
                messages, SamplingParams(max_tokens=96),
                tools=[WEATHER_SHORT if short else WEATHER],
                tool_choice="required", parallel_tool_calls=parallel)))
        else:
            messages = [{"role": "user", "content": f"Plan a trip to {city}: answer as JSON "
                         "with destination, days and season."}]
            handles.append(eng.submit(ChatRequest.from_openai(
                messages, SamplingParams(max_tokens=64, constraint=TRIP_SHORT if short else TRIP))))
    results = [h.result() for h in handles]
    wall = time.perf_counter() - started
    after = eng.stats()
    return Run(wall, sum(r.usage.completion_tokens for r in results),
               after.forced_tokens - before.forced_tokens, after.steps - before.steps,
               results[0].text)


DOC = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
       "France. It is named after the engineer Gustave Eiffel, whose company designed and "
       "built the tower from 1887 to 1889. Locally nicknamed La dame de fer, it was "
       "constructed as the centrepiece of the 1889 World's Fair. The tower is 330 metres "
       "tall, about the same height as an 81-storey building, and the tallest structure "
       "in Paris.")
CODE = ("def area(width, height):\n    result = width * height\n    return result\n\n\n"
        "def perimeter(width, height):\n    result = 2 * (width + height)\n    return result\n")
SPEC_LOADS: dict[str, tuple[list[dict[str, str]], dict[str, Any]]] = {
    "RAG quote": ([{"role": "system",
                    "content": f"Answer by quoting the context.\nContext: {DOC}"},
                   {"role": "user", "content": "Repeat the context word for word."}], {}),
    "code edit": ([{"role": "user", "content": "Rename the parameter width to w in this code "
                    f"and print the whole code:\n{CODE}"}], {}),
    "free prose": ([{"role": "user",
                     "content": "Write a short story about a lighthouse keeper."}], {}),
    # Parallel calls allowed: a second call may follow (an exact repeat ends the row and
    # is dropped; the default model writes this one once, 2026-12-05).
    "forced call, parallel allowed": ([{"role": "user", "content": "What is the weather in "
                                        "Paris in celsius?"}],
                                      {"tools": [WEATHER], "tool_choice": "required"}),
}


def spec_load(eng: Engine, load: tuple[list[dict[str, str]], dict[str, Any]],
              rows: int) -> tuple[Run, list[Any]]:
    messages, options = load
    before = eng.stats()
    started = time.perf_counter()
    request = ChatRequest.from_openai(messages, SamplingParams(max_tokens=96), **options)
    handles = [eng.submit(request) for _ in range(rows)]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - started
    after = eng.stats()
    return Run(wall, sum(r.usage.completion_tokens for r in results),
               after.drafted_tokens - before.drafted_tokens,
               after.steps - before.steps, results[0].text), [r.token_ids for r in results]


def speculation_table(model: str | None, spec_rows: int, load_rows: list[int],
                      repeats: int) -> None:
    engines = {flag: Engine(model, EngineConfig(speculation=spec_rows if flag else 0)).start()
               for flag in (True, False)}
    for eng in engines.values():
        for spec in SPEC_LOADS.values():  # warm-up: heads cached, grammars compiled
            spec_load(eng, spec, 1)
    print(f"\nspeculation={spec_rows} vs off, at most 96 greedy tokens a row "
          f"({engines[True].model_path.name})")
    print("| load | rows | speculation | wall s | tokens | drafted | steps | tok/s | speed-up "
          "| same |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for title, messages in SPEC_LOADS.items():
        for rows in load_rows:
            runs: dict[bool, list[Run]] = {True: [], False: []}
            answers: dict[bool, Any] = {}
            for _ in range(repeats):
                for flag, eng in engines.items():
                    run, answers[flag] = spec_load(eng, messages, rows)
                    runs[flag].append(run)
            on, off = best(runs[True]), best(runs[False])
            same = "yes" if answers[True] == answers[False] else "NO"
            for flag, run in ((False, off), (True, on)):
                ratio = f"{off.wall / on.wall:.2f}x" if flag else ""
                print(f"| {title} | {rows} | {'on' if flag else 'off'} | {run.wall:.2f} | "
                      f"{run.tokens} | {run.forced} | {run.steps} | {run.rate:.1f} | {ratio} | "
                      f"{same if flag else ''} |")
    for eng in engines.values():
        eng.close()


def best(runs: list[Run]) -> Run:
    return min(runs, key=lambda r: r.wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spec-rows", type=int, default=1)
    parser.add_argument("--spec-load-rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip-ff", action="store_true")
    parser.add_argument("--skip-spec", action="store_true")
    parser.add_argument("--kinds", nargs="*", default=[],
                        help="also ~100M random models of these mlx-lm types")
    parser.add_argument("--kinds-spec", action="store_true",
                        help="run part 2 on the --kinds models too")
    parser.add_argument("--short", action="store_true",
                        help="bounded strings in part 1's loads (a random --model)")
    parser.add_argument("--check-repeats", type=int, default=9)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--fresh", action="store_true",
                        help="part 1 only, each load the first request of a fresh process")
    parser.add_argument("--fresh-child", nargs=3, metavar=("FF", "KIND", "ROWS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fresh_child:
        fresh_child(args.model, *args.fresh_child)
        return
    print(f"BLAS: {blas_info().name}")
    if args.fresh:
        fresh_table(args.model, args.rows, args.repeats)
        return
    models: list[str | None] = [args.model]
    if args.kinds:
        tokenizer = Path(resolve_model(args.model))
        models += [str(bench_model(kind, tokenizer, BENCH_MODELS)) for kind in args.kinds]
    for i, model in enumerate(models):
        if not args.skip_ff:
            fast_forward_table(model, args.rows, args.repeats, short=i > 0 or args.short)
        if not args.skip_spec and (i == 0 or args.kinds_spec):
            speculation_table(model, args.spec_rows, args.spec_load_rows, args.repeats)
    if not args.skip_check:
        check_cost_table(models, args.check_repeats)


def check_cost_table(models: list[str | None], repeats: int) -> None:
    """A check (7 tokens on a row's own cache) against a step (1 token), per cache kind."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.rows.row_cache import Rollback, trimmed, trims_exactly
    from engine.device.speedups.report import cache_kinds

    print("\nspeculation check vs decode step, one row on its own cache after 500 tokens")
    print("| model | cache kinds | step ms | check ms | check / step | rejected drafts |")
    print("|---|---|---:|---:|---:|---|")
    for model in models:
        path = resolve_model(model)
        weights, _ = mlx_load(str(path))
        cache = make_prompt_cache(weights)
        weights(mx.array([list(range(1000, 1500))]), cache=cache)
        mx.eval([c.state for c in cache])
        trims = trims_exactly(cache)
        times: dict[int, list[float]] = {1: [], 7: []}
        for _ in range(repeats):
            for width in (1, 7):
                mark = None if trims or width == 1 else Rollback.of(cache)
                started = time.perf_counter()
                out = weights(mx.array([list(range(2000, 2000 + width))]), cache=cache)
                if width > 1:  # a rejected draft: six tokens taken back
                    if mark is not None:
                        mark.restore(cache)
                    else:
                        trimmed(cache, width - 1)
                mx.eval(out, [c.state for c in cache])
                times[width].append(time.perf_counter() - started)
        step, check = (statistics.median(times[w]) * 1000 for w in (1, 7))
        how = "trimmed" if trims else "rolled back (state)"
        print(f"| {Path(path).name} | {', '.join(cache_kinds(cache))} | {step:.1f} | "
              f"{check:.1f} | {check / step:.2f} | {how} |")


def fresh_child(model: str | None, flag: str, kind: str, rows: str) -> None:
    """One load as the first request of this process; its Run as JSON on stdout."""
    eng = Engine(model, EngineConfig(fast_forward=flag == "1")).start()
    run = load(eng, kind, int(rows))
    decision = {s.name: s.measured for s in eng.stats().speedups}["fast_forward"]
    eng.close()
    print(json.dumps({**run.__dict__, "decision": decision}))


def fresh_table(model: str | None, rows_list: list[int], repeats: int) -> None:
    """Part 1's loads, each the first request of its own process; the median of
    ``repeats`` runs a side, on and off alternating."""
    print("| load | rows | ff | wall s (median) | tokens | forced | steps | speed-up |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    decisions = []
    for kind, title in (("tool", "forced tool call"), ("schema", "schema answer (Trip)")):
        for rows in rows_list:
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for _ in range(repeats):
                for flag in (True, False):
                    command = [sys.executable, __file__, "--fresh-child", str(int(flag)), kind,
                               str(rows)] + (["--model", model] if model else [])
                    out = subprocess.run(command, check=True, capture_output=True, text=True)
                    runs[flag].append(json.loads(out.stdout.strip().splitlines()[-1]))
            walls = {flag: statistics.median(r["wall"] for r in runs[flag]) for flag in runs}
            for flag in (False, True):
                run = runs[flag][0]
                ratio = f"{walls[False] / walls[True]:.2f}x" if flag else ""
                print(f"| {title} | {rows} | {'on' if flag else 'off'} | {walls[flag]:.2f} | "
                      f"{run['tokens']} | {run['forced']} | {run['steps']} | {ratio} |",
                      flush=True)
            decisions.append(f"{title}, {rows} rows: {runs[True][-1]['decision']}")
    print("\nfast-forward's decision after each first load (stats().speedups):")
    for line in decisions:
        print(f"- {line}")


def fast_forward_table(model: str | None, rows_list: list[int], repeats: int,
                       short: bool = False) -> None:
    engines = {flag: Engine(model, EngineConfig(fast_forward=flag)).start()
               for flag in (True, False)}
    print(f"model: {engines[True].model_path}\n")
    for eng in engines.values():  # warm-up: grammars compiled, prompts' heads cached
        load(eng, "tool", 1, short=short)
        load(eng, "schema", 1, short=short)
    loads: list[tuple[str, str, dict[str, Any]]] = [
        ("forced tool call", "tool", {}),
        ("forced tool call, parallel allowed", "tool", {"parallel": True}),
        ("schema answer (Trip)", "schema", {}),
    ]
    print("| load | rows | ff | wall s | tokens | forced | steps | tok/s | speed-up |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for title, kind, options in loads:
        for rows in rows_list:
            runs: dict[bool, list[Run]] = {True: [], False: []}
            for _ in range(repeats):
                for flag, eng in engines.items():
                    runs[flag].append(load(eng, kind, rows, short=short, **options))
            on, off = best(runs[True]), best(runs[False])
            for flag, run in ((False, off), (True, on)):
                ratio = f"{off.wall / on.wall:.2f}x" if flag else ""
                print(f"| {title} | {rows} | {'on' if flag else 'off'} | {run.wall:.2f} | "
                      f"{run.tokens} | {run.forced} | {run.steps} | {run.rate:.1f} | {ratio} |")
    sample = load(engines[True], "tool", 1, short=short).sample
    print(f"\nsample answers (fast-forward on): {sample!r}")
    measured = {s.name: s.measured for s in engines[True].stats().speedups}["fast_forward"]
    print(f"fast-forward's decision (stats().speedups): {measured}")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
