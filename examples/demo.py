"""The main demo: one shared engine on the default model, many requests in one batch.

Streams one answer token by token, then answers eight questions concurrently from
eight threads (they decode as rows of one batch), then prints the engine's stats.

    make demo        # or: python examples/demo.py [--model PATH_OR_GGUF]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import engine  # noqa: F401 - import before mlx: loads the fast BLAS on Linux
from engine import Engine, EngineConfig, SamplingParams, blas_info

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Which planet is known as the red planet?",
    "What is H2O commonly called?",
    "How many days are in a week?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model dir, .gguf, or hub id")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    print(f"BLAS: {blas_info().name}", file=sys.stderr)
    with Engine(args.model, EngineConfig(max_batch=16)) as eng:
        t0 = time.perf_counter()
        eng.start()
        print(f"model: {eng.model_path} (loaded in {time.perf_counter() - t0:.1f} s)\n")

        params = SamplingParams(max_tokens=args.max_tokens)
        print(f"> {QUESTIONS[0]}")
        for event in eng.submit([{"role": "user", "content": QUESTIONS[0]}], params):
            print(event.text, end="", flush=True)
        print("\n")

        def ask(question: str) -> tuple[str, str, float]:
            result = eng.submit([{"role": "user", "content": question}], params).result()
            return question, result.text.strip(), result.usage.completion_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(ask, QUESTIONS))
        elapsed = time.perf_counter() - t0
        for question, answer, _ in answers:
            print(f"> {question}\n  {answer}\n")
        tokens = sum(n for _, _, n in answers)
        stats = eng.stats()
        print(f"{len(QUESTIONS)} concurrent requests: {tokens} tokens in {elapsed:.1f} s "
              f"({tokens / elapsed:.0f} tok/s aggregate), peak batch {stats.peak_running} rows")
        print(f"stats: {stats}")


if __name__ == "__main__":
    main()
