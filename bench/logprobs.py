"""What logprobs cost: 16 ChatMLXBatch streams at once, without logprobs, with logprobs,
and with top_logprobs=5, same model, same prompts, same run (greedy: the same tokens).

    python bench/logprobs.py [--model PATH_OR_GGUF] [--rows 16] [--tokens 64] [--repeats 2]

Everything a caller pays is in the figure: the engine reading each row's logprob (and its
top alternatives) from the step's logits, and the face turning them into ChatOpenAI's
shape on every streamed chunk. Decode rate = generated tokens / (last chunk time - first
chunk time), all rows; modes interleaved, best of ``--repeats`` (less noise on a shared CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import engine  # noqa: F401 - before mlx: loads the fast BLAS first
from engine import blas_info
from mlx_providers import ChatMLXBatch

TOPICS = ["the sea", "a robot", "tea", "mountains", "a city at night", "an old clock",
          "rain", "a library", "the moon", "bread", "a violin", "snow", "a garden",
          "trains", "a lighthouse", "autumn"]
MODES: dict[str, dict[str, Any]] = {
    "no logprobs": {},
    "logprobs": {"logprobs": True},
    "top_logprobs=5": {"logprobs": True, "top_logprobs": 5},
}


async def decode_rate(chat: ChatMLXBatch, prompts: list[str], options: dict[str, Any]) -> tuple[
        float, int]:
    """Every prompt streamed at once: decode tok/s over all rows, and tokens generated."""
    stamps: list[float] = []
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        async for chunk in chat.astream(prompt, **options):
            stamps.append(time.perf_counter())
            if chunk.usage_metadata:
                tokens += chunk.usage_metadata["output_tokens"]

    await asyncio.gather(*(one(p) for p in prompts))
    return tokens / (max(stamps) - min(stamps)), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompts = [f"Tell a long story about {TOPICS[i % len(TOPICS)]}." for i in range(args.rows)]
    chat = ChatMLXBatch(model=args.model, max_tokens=args.tokens,
                        engine_config={"max_batch": max(args.rows, 1)})
    chat.invoke("Hello", max_tokens=4, logprobs=True, top_logprobs=5)  # load and warm up
    print(f"model: {chat.engine.model_path}\nBLAS: {blas_info().name}\n")
    best = dict.fromkeys(MODES, 0.0)
    generated = dict.fromkeys(MODES, 0)
    for _ in range(args.repeats):
        for mode, options in MODES.items():
            rate, tokens = asyncio.run(decode_rate(chat, prompts, options))
            best[mode], generated[mode] = max(best[mode], rate), tokens
    peak = chat.engine.stats().peak_running
    chat.engine.close()
    print("| rows | mode | tokens | decode tok/s | vs no logprobs |")
    print("|-----:|------|-------:|-------------:|---------------:|")
    for mode, rate in best.items():
        print(f"| {args.rows} | {mode} | {generated[mode]} | {rate:.1f} | "
              f"{rate / best['no logprobs']:.3f} |")
    print(f"\npeak rows decoding together: {peak}")


if __name__ == "__main__":
    main()
