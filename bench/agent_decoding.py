"""What agents decode: forced tool calls and schema answers, grammar fast-forward on vs off.

Two engines on the same model in one process, one with ``fast_forward=True`` (the
default) and one with ``False``, run the same loads in alternation (best of
``--repeats``). A load is ``rows`` concurrent requests, each about its own city, submitted
at once; wall time runs from the first submit to the last result. Steps are the engine's
lane steps over the load; forced tokens are those the grammar dictated.

    python bench/agent_decoding.py [--model PATH_OR_GGUF] [--rows 1 4 8 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig, JsonSchema, SamplingParams, blas_info

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
            handles.append(eng.submit(messages, SamplingParams(max_tokens=96), tools=[WEATHER],
                                      tool_choice="required", parallel_tool_calls=parallel))
        else:
            messages = [{"role": "user", "content": f"Plan a trip to {city}: answer as JSON "
                         "with destination, days and season."}]
            handles.append(eng.submit(messages, SamplingParams(max_tokens=64, constraint=TRIP)))
    results = [h.result() for h in handles]
    wall = time.perf_counter() - started
    after = eng.stats()
    return Run(wall, sum(r.usage.completion_tokens for r in results),
               after.forced_tokens - before.forced_tokens, after.steps - before.steps,
               results[0].text)


def best(runs: list[Run]) -> Run:
    return min(runs, key=lambda r: r.wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    engines = {flag: Engine(args.model, EngineConfig(fast_forward=flag)).start()
               for flag in (True, False)}
    print(f"model: {engines[True].model_path}\nBLAS: {blas_info().name}\n")
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
        for rows in args.rows:
            runs: dict[bool, list[Run]] = {True: [], False: []}
            for _ in range(args.repeats):
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
