"""16 concurrent LangChain chains through ChatMLXBatch vs the same 16 one after another.

The baseline is what the langchain-community ``ChatMLX`` integration does (when it works
on mlx-lm 0.32): one ``mlx_lm.stream_generate`` call per request, in turn. Same model, same
prompts, same greedy settings, same run. Aggregate rate = generated tokens / wall time,
prefill included, as a user of the chains sees it.

    python bench/langchain_concurrency.py [--model PATH_OR_GGUF] [--chains 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from langchain_core.prompts import ChatPromptTemplate

import engine  # before mlx_lm: loads the fast BLAS first
from mlx_providers import ChatMLXBatch

TOPICS = ["the sea", "a robot", "tea", "mountains", "a city at night", "an old clock",
          "rain", "a library", "the moon", "bread", "a violin", "snow", "a garden",
          "trains", "a lighthouse", "autumn"]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a storyteller."),
    ("human", "Tell a long story about {topic}."),
])


@dataclass(frozen=True)
class Run:
    """One side of the comparison."""

    name: str
    requests: int
    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


async def batched(model: str | None, topics: list[str], tokens: int) -> Run:
    """Every chain at once through ChatMLXBatch (each with its own instance)."""
    chains = [PROMPT | ChatMLXBatch(model=model, max_tokens=tokens) for _ in topics]
    start = time.perf_counter()
    answers = await asyncio.gather(*(c.ainvoke({"topic": t}) for c, t in zip(chains, topics)))
    seconds = time.perf_counter() - start
    generated = sum((a.usage_metadata or {}).get("output_tokens", 0) for a in answers)
    return Run("ChatMLXBatch, concurrent ainvoke", len(topics), generated, seconds)


def sequential(model_path: str, topics: list[str], tokens: int) -> Run:
    """The same chains one after another with mlx_lm.stream_generate."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(model_path)
    sampler = make_sampler(temp=0.0)

    def generate(topic: str, max_tokens: int) -> int:
        messages = [{"role": m.type.replace("human", "user"), "content": m.content}
                    for m in PROMPT.format_messages(topic=topic)]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        count = 0
        for _ in stream_generate(model, tokenizer, text, max_tokens=max_tokens, sampler=sampler):
            count += 1
        return count

    generate(topics[0], 4)  # warm-up, like the engine side's
    start = time.perf_counter()
    generated = sum(generate(t, tokens) for t in topics)
    return Run("mlx_lm.stream_generate, one at a time", len(topics), generated,
               time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    topics = [TOPICS[i % len(TOPICS)] for i in range(args.chains)]

    chat = ChatMLXBatch(model=args.model, max_tokens=4)
    chat.invoke("Hello")  # load and warm up the shared engine
    blas = getattr(engine, "blas_info", None)
    print(f"model: {chat.engine.model_path}")
    print(f"BLAS: {blas().name if blas else 'unknown'}\n")

    ours = asyncio.run(batched(args.model, topics, args.tokens))
    peak = chat.engine.stats().peak_running
    model_path = str(chat.engine.model_path)
    chat.engine.close()  # the baseline gets the machine to itself
    base = sequential(model_path, topics, args.tokens)

    print(f"{'':40} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    for run in (base, ours):
        print(f"{run.name:40} {run.requests:8d} {run.tokens:7d} {run.seconds:8.2f} "
              f"{run.rate:8.1f}")
    print(f"\npeak rows decoding together: {peak}")
    print(f"ratio (batched / sequential tok/s): {ours.rate / base.rate:.2f}x")


if __name__ == "__main__":
    main()
