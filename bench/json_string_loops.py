"""Greedy loops inside constrained JSON strings, with and without the n-gram guard.

    python bench/json_string_loops.py [--model PATH_OR_GGUF] [--max-tokens 256]
                                      [--ngrams 0,3,4,6]

Each schema-constrained chat prompt below runs greedily, all in one batch, once per
``EngineConfig.json_string_ngram`` setting (0 = the guard off: the baseline, same run).
Per setting the table shows how many answers were complete JSON that validates against
the schema, how many were cut at ``max_tokens``, the mean tokens written, and the share
of repeated token 4-grams inside string values (a loop measure: 0 = no 4-gram twice).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jsonschema

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import ChatRequest, Engine, EngineConfig, FinishReason, SamplingParams, blas_info
from engine.requests.inbound.output_constraint import JsonSchema

_STR = {"type": "string"}
_INT = {"type": "integer"}

# (prompt, schema): free-text strings, where small greedy models loop.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Tell me a joke about cats.", {"properties": {"setup": _STR, "punchline": _STR}}),
    ("Tell me a joke about dogs.", {"properties": {"setup": _STR, "punchline": _STR}}),
    ("Describe a fictional person.", {"properties": {"name": _STR, "bio": _STR, "age": _INT}}),
    ("Give me a pancake recipe.",
     {"properties": {"title": _STR, "steps": {"type": "array", "items": _STR}}}),
    ("Review the movie Titanic.",
     {"properties": {"title": _STR, "summary": _STR, "rating": _INT}}),
    ("Write a product description for a coffee mug.",
     {"properties": {"product": _STR, "description": _STR}}),
    ("What is the weather like in Paris in spring?",
     {"properties": {"city": _STR, "forecast": _STR}}),
    ("Summarize the story of Cinderella.", {"properties": {"title": _STR, "summary": _STR}}),
    ("Name a country and describe its capital.",
     {"properties": {"country": _STR, "capital": _STR, "description": _STR}}),
    ("Explain photosynthesis to a child.", {"properties": {"topic": _STR, "explanation": _STR}}),
    ("Invent a superhero.", {"properties": {"name": _STR, "power": _STR, "weakness": _STR}}),
    ("Tell me a fun fact about space.", {"properties": {"fact": _STR, "source": _STR}}),
]


def _schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", **properties, "required": list(properties["properties"])}


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def _repeated_share(eng: Engine, texts: list[str]) -> tuple[int, int]:
    """(repeated 4-grams, all 4-grams) over the token ids of each string."""
    repeated = total = 0
    for text in texts:
        ids = _encode(eng, text)
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated, total


def _encode(eng: Engine, text: str) -> list[int]:
    tokenizer = eng.tokenizer
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(model: str | None, ngram: int, max_tokens: int) -> dict[str, float]:
    eng = Engine(model, EngineConfig(json_string_ngram=ngram)).start()
    try:
        started = time.perf_counter()
        handles = [eng.submit(ChatRequest.from_openai(
                       [{"role": "user", "content": prompt}],
                       SamplingParams(max_tokens=max_tokens,
                                      constraint=JsonSchema(_schema(props)))))
                   for prompt, props in CASES]
        results = [h.result() for h in handles]
        seconds = time.perf_counter() - started
        valid = cut = repeated = grams = tokens = 0
        for (_, props), result in zip(CASES, results):
            tokens += result.usage.completion_tokens
            if result.finish_reason is FinishReason.LENGTH:
                cut += 1
                continue
            try:
                value = json.loads(result.text)
                jsonschema.validate(value, _schema(props))
            except (ValueError, jsonschema.ValidationError):
                continue
            valid += 1
            r, g = _repeated_share(eng, _strings(value))
            repeated, grams = repeated + r, grams + g
        return {"valid": valid, "cut": cut, "tokens": tokens / len(CASES),
                "repeated": repeated / grams if grams else 0.0, "seconds": seconds}
    finally:
        eng.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ngrams", default="0,3,4,6")
    args = parser.parse_args()
    print(f"BLAS: {blas_info().name}; {len(CASES)} schema prompts, greedy, "
          f"max_tokens={args.max_tokens}\n")
    print(f"{'ngram':>6} {'valid':>6} {'cut':>4} {'tokens/answer':>14} "
          f"{'repeated 4-grams':>17} {'seconds':>8}")
    for ngram in (int(n) for n in args.ngrams.split(",")):
        row = run(args.model, ngram, args.max_tokens)
        label = "off" if ngram == 0 else str(ngram)
        print(f"{label:>6} {row['valid']:>3}/{len(CASES):<2} {row['cut']:>4} "
              f"{row['tokens']:>14.1f} {row['repeated']:>17.1%} {row['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
