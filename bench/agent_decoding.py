"""What agents decode: grammar fast-forward on vs off, and speculation on vs off.

Part 1, forced tool calls and schema answers: two engines on the same model in one
process, ``fast_forward=True`` (the default) and ``False``, run the same loads in
alternation (best of ``--repeats``). A load is ``rows`` concurrent requests, each about
its own city, submitted at once; wall time runs from the first submit to the last result.
Steps are the engine's lane steps over the load; forced tokens are those the grammar
dictated.

Part 2, prompt-lookup speculation: an engine with ``speculation=--spec-rows`` against one
with it off, on three greedy loads (an answer quoting its RAG context, a code edit, free
prose) at ``--spec-load-rows`` concurrent rows; the answers must be identical.

    python bench/agent_decoding.py [--model PATH_OR_GGUF] [--rows 1 4 8 16] [--repeats 2]
        [--spec-rows 1] [--spec-load-rows 1 2 4] [--skip-ff] [--skip-spec]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import ChatRequest, Engine, EngineConfig, JsonSchema, SamplingParams, blas_info

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul",
          "Dakar", "Perth", "Hanoi", "Bern", "Doha", "Riga", "Kyiv"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TRIP = JsonSchema({"type": "object", "properties": {
    "destination": {"type": "string"}, "days": {"type": "integer"},
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


def load(eng: Engine, kind: str, rows: int, parallel: bool = False) -> Run:
    before = eng.stats()
    started = time.perf_counter()
    handles = []
    for i in range(rows):
        city = CITIES[i % len(CITIES)]
        if kind == "tool":
            messages = [{"role": "user", "content": f"What is the weather in {city} in celsius?"}]
            handles.append(eng.submit(ChatRequest.from_openai(
                messages, SamplingParams(max_tokens=96), tools=[WEATHER],
                tool_choice="required", parallel_tool_calls=parallel)))
        else:
            messages = [{"role": "user", "content": f"Plan a trip to {city}: answer as JSON "
                         "with destination, days and season."}]
            handles.append(eng.submit(ChatRequest.from_openai(
                messages, SamplingParams(max_tokens=64, constraint=TRIP))))
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
SPEC_LOADS = {
    "RAG quote": [{"role": "system", "content": f"Answer by quoting the context.\nContext: {DOC}"},
                  {"role": "user", "content": "Repeat the context word for word."}],
    "code edit": [{"role": "user", "content": "Rename the parameter width to w in this code "
                   f"and print the whole code:\n{CODE}"}],
    "free prose": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
}


def spec_load(eng: Engine, messages: list[dict[str, str]], rows: int) -> tuple[Run, list[Any]]:
    before = eng.stats()
    started = time.perf_counter()
    request = ChatRequest.from_openai(messages, SamplingParams(max_tokens=96))
    handles = [eng.submit(request) for _ in range(rows)]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - started
    after = eng.stats()
    return Run(wall, sum(r.usage.completion_tokens for r in results), 0,
               after.steps - before.steps, results[0].text), [r.token_ids for r in results]


def speculation_table(model: str | None, spec_rows: int, load_rows: list[int],
                      repeats: int) -> None:
    engines = {flag: Engine(model, EngineConfig(speculation=spec_rows if flag else 0)).start()
               for flag in (True, False)}
    for eng in engines.values():
        for messages in SPEC_LOADS.values():  # warm-up: heads cached
            spec_load(eng, messages, 1)
    print(f"\nspeculation={spec_rows} vs off, 96 greedy tokens a row")
    print("| load | rows | speculation | wall s | tokens | steps | tok/s | speed-up | same |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
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
                      f"{run.tokens} | {run.steps} | {run.rate:.1f} | {ratio} | "
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
    args = parser.parse_args()
    print(f"BLAS: {blas_info().name}")
    if not args.skip_ff:
        fast_forward_table(args.model, args.rows, args.repeats)
    if not args.skip_spec:
        speculation_table(args.model, args.spec_rows, args.spec_load_rows, args.repeats)


def fast_forward_table(model: str | None, rows_list: list[int], repeats: int) -> None:
    engines = {flag: Engine(model, EngineConfig(fast_forward=flag)).start()
               for flag in (True, False)}
    print(f"model: {engines[True].model_path}\n")
    for eng in engines.values():  # warm-up: grammars compiled, prompts' heads cached
        load(eng, "tool", 1)
        load(eng, "schema", 1)
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
                    runs[flag].append(load(eng, kind, rows, **options))
            on, off = best(runs[True]), best(runs[False])
            for flag, run in ((False, off), (True, on)):
                ratio = f"{off.wall / on.wall:.2f}x" if flag else ""
                print(f"| {title} | {rows} | {'on' if flag else 'off'} | {run.wall:.2f} | "
                      f"{run.tokens} | {run.forced} | {run.steps} | {run.rate:.1f} | {ratio} |")
    print(f"\nsample answers (fast-forward on): {load(engines[True], 'tool', 1).sample!r}")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
