"""Fan out LangChain chains on one shared MLX batch, then print the engine's statistics.

    python examples/langchain_parallel.py            # the default model (SmolLM2-135M)
    python examples/langchain_parallel.py --model path/to/mlx-model-dir

Every chain below is an ordinary LangChain runnable. Because all ``ChatMLXBatch``
instances for one model share one engine, the concurrent calls decode as rows of the
same batch: no batching code in sight.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from mlx_providers import ChatMLXBatch

TOPICS = ["the sea", "a city at night", "autumn", "a robot", "coffee", "mountains"]


async def main(model: str | None) -> None:
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are a poet. Answer with one short line."),
        ("human", "Write a line about {topic}."),
    ])
    poet = prompt | ChatMLXBatch(model=model, max_tokens=32, temperature=0.7) | StrOutputParser()
    # A second chain with its own ChatMLXBatch: it still joins the same batch.
    critic = (ChatPromptTemplate.from_template("In three words, what mood has: {topic}?")
              | ChatMLXBatch(model=model, max_tokens=12) | StrOutputParser())

    start = time.perf_counter()
    lines, moods = await asyncio.gather(
        poet.abatch([{"topic": t} for t in TOPICS]),
        critic.abatch([{"topic": t} for t in TOPICS]),
    )
    elapsed = time.perf_counter() - start

    for topic, line, mood in zip(TOPICS, lines, moods):
        print(f"{topic:>16}: {line.strip()!r}  [{mood.strip()}]")
    stats = ChatMLXBatch(model=model).engine.stats()
    print(f"\n{2 * len(TOPICS)} requests in {elapsed:.1f} s; "
          f"peak rows decoding together: {stats.peak_running}; "
          f"tokens generated: {stats.generated_tokens}; batch steps: {stats.steps}; "
          f"completed: {stats.completed}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    asyncio.run(main(parser.parse_args().model))
