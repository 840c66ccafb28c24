"""Cost of constrained decoding inside the batch: 16 rows with 8 schema-constrained
versus 16 unconstrained, same model, same prompts, same run.

    python bench/constrained.py [--model PATH_OR_GGUF] [--tokens 64] [--rows 16]

Decode rate = generated tokens / (last token time - first token time), all rows.
"""

from __future__ import annotations

import argparse
import threading
import time

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import ChatRequest, Engine, EngineConfig, SamplingParams, blas_info
from engine.requests.inbound.output_constraint import JsonSchema

# Cannot complete within the token budget, so constrained rows decode as long as the rest.
LONG_LIST = JsonSchema({"type": "array", "minItems": 200,
                        "items": {"type": "string", "maxLength": 24}})


def run(eng: Engine, prompts: list[list[dict[str, str]]], constrained: int,
        tokens: int) -> float:
    stamps: list[float] = []
    lock = threading.Lock()

    def on_token(_t: int, _d: str) -> None:
        with lock:
            stamps.append(time.perf_counter())

    handles = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True,
                                constraint=LONG_LIST if i < constrained else None)
        handles.append(eng.submit(ChatRequest.from_openai(prompt, params), on_token=on_token))
    for handle in handles:
        handle.result()
    return len(stamps) / (max(stamps) - min(stamps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    eng = Engine(args.model, EngineConfig(max_batch=args.rows)).start()
    print(f"model: {eng.model_path}\nBLAS: {blas_info().name}\n")
    prompts = [[{"role": "user", "content": f"List {i + 3} fruits as a JSON array."}]
               for i in range(args.rows)]
    run(eng, prompts[:2], 1, 8)  # warm-up, and compiles the grammar once
    half = args.rows // 2
    best = {0: 0.0, half: 0.0}
    for _ in range(args.repeats):  # interleaved, best of n: less noise on a shared CPU
        for constrained in best:
            best[constrained] = max(best[constrained], run(eng, prompts, constrained,
                                                           args.tokens))
    print("| rows | constrained rows | decode tok/s | vs unconstrained |")
    print("|-----:|-----------------:|-------------:|-----------------:|")
    for constrained, rate in best.items():
        print(f"| {args.rows} | {constrained} | {rate:.1f} | {rate / best[0]:.3f} |")
    eng.close()


if __name__ == "__main__":
    main()
