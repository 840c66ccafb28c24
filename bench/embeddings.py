"""Embeddings: sentences per second by batch size, and what they cost a decoding batch.

Table 1: the MLX encoder on the engine thread (``Engine.embed``, one request of N
sentences) at batch 1, 8, 32 and 128, against the independent numpy reference of the
tests (testkit/numpy_bert.py: float64, one sentence at a time; a correctness reference,
not a tuned baseline), on the default all-MiniLM-L6-v2.

Table 2: ``--rows`` greedy rows decode ``--tokens`` tokens each on the default chat model,
alone and then while a thread keeps ``--embed-batch``-sentence requests coming; the rows'
aggregate tok/s with and without, their ratio, the embedding rate reached meanwhile and
the encoder's share of the engine's time, at the default ``embed_share`` (0.5) and
uncapped (1.0). The rows' tokens are checked to be the same in every run.

    python bench/embeddings.py [--sentences 256] [--rows 8] [--tokens 64] [--embed-batch 32]
                               [--repeats 2]
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for testkit.numpy_bert

from engine import (  # the fast BLAS first
    ChatRequest,
    Engine,
    EngineConfig,
    SamplingParams,
    blas_info,
)
from testkit.numpy_bert import NumpyBert

WORDS = ["the", "a", "engine", "batch", "model", "river", "bright", "quickly", "sings",
         "under", "over", "data", "token", "cache", "small", "large", "green", "network",
         "answer", "question", "document", "index", "query", "fast", "slow", "tree",
         "mountain", "city", "light", "reads", "writes", "learns", "finds", "keeps", "every",
         "some", "many", "one", "two"]


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))).capitalize() + "."
            for _ in range(n)]


def mlx_rate(eng: Engine, texts: list[str], batch: int) -> float:
    """Sentences per second, ``batch`` sentences per request, one request at a time."""
    started = time.perf_counter()
    for i in range(0, len(texts), batch):
        eng.embed(texts[i:i + batch]).result()
    return len(texts) / (time.perf_counter() - started)


def numpy_rate(reference: NumpyBert, texts: list[str]) -> float:
    started = time.perf_counter()
    for text in texts:
        reference.embed(text)
    return len(texts) / (time.perf_counter() - started)


def decode(eng: Engine, rows: int, tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    """Aggregate tok/s of ``rows`` greedy rows, and their tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Write a story about {w}."}]
               for w in WORDS[:rows]]
    started = time.perf_counter()
    handles = [eng.submit(ChatRequest.from_openai(p, params)) for p in prompts]
    results = [h.result() for h in handles]
    elapsed = time.perf_counter() - started
    return sum(r.usage.completion_tokens for r in results) / elapsed, [r.token_ids
                                                                       for r in results]


def beside_embeddings(eng: Engine, texts: list[str], batch: int,
                      args: argparse.Namespace) -> tuple[float, list[tuple[int, ...]], float,
                                                         float]:
    """Decode while a thread sends ``batch``-sentence requests back to back: the rows'
    tok/s and tokens, the sentences/s embedded meanwhile, the encoder's share of the time."""
    stop = threading.Event()
    embedded = [0]
    if batch == 0:  # no embeddings: the baseline
        tok_s, tokens = decode(eng, args.rows, args.tokens)
        return tok_s, tokens, 0.0, 0.0

    def keep_embedding() -> None:
        i = 0
        while not stop.is_set():
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            eng.embed(chunk).result()
            embedded[0] += len(chunk)
            i += batch

    before = eng.stats().embed_seconds
    worker = threading.Thread(target=keep_embedding, daemon=True)
    worker.start()
    started = time.perf_counter()
    tok_s, tokens = decode(eng, args.rows, args.tokens)
    elapsed = time.perf_counter() - started
    stop.set()
    worker.join()
    share = (eng.stats().embed_seconds - before) / elapsed
    return tok_s, tokens, embedded[0] / elapsed, share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--reference-sentences", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--embed-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.system()}, "
          f"BLAS: {blas_info().name}")
    texts = sentences(args.sentences)

    with Engine(None, EngineConfig(max_batch=max(16, args.rows))) as eng:
        eng.embed(texts[:8]).result()  # fetch and load the encoder before timing
        reference = NumpyBert(eng.embedding_model_path())
        ref = numpy_rate(reference, texts[:args.reference_sentences])
        print("\n## Sentences per second (all-MiniLM-L6-v2)")
        print(f"numpy reference (float64, one at a time): {ref:.1f} sentences/s\n")
        print("| batch | MLX engine sentences/s | vs numpy reference |")
        print("|---:|---:|---:|")
        for batch in (1, 8, 32, 128):
            rate = mlx_rate(eng, texts, batch)
            print(f"| {batch} | {rate:.1f} | {rate / ref:.1f}x |", flush=True)

        eng.start()
        uncapped = Engine(None, EngineConfig(max_batch=max(16, args.rows), embed_share=1.0))
        uncapped.embed(texts[:8]).result()
        uncapped.start()
        for one in (eng, uncapped):
            decode(one, 2, 4)  # warm-up: the chat model's first steps
        loads = [("decode alone", eng, 0), ("decode + 1-sentence requests", eng, 1),
                 (f"decode + {args.embed_batch}-sentence requests", eng, args.embed_batch),
                 (f"decode + {args.embed_batch}-sentence requests, embed_share=1.0 (no cap)",
                  uncapped, args.embed_batch)]
        best: dict[str, tuple[float, float, float]] = {}
        alone_tokens: list[tuple[int, ...]] = []
        unchanged = True
        for _ in range(args.repeats):  # loads alternate; the best of each is kept
            for name, one, batch in loads:
                tok_s, tokens, rate, share = beside_embeddings(one, texts, batch, args)
                alone_tokens = alone_tokens or tokens
                unchanged = unchanged and tokens == alone_tokens
                if tok_s > best.get(name, (0.0, 0.0, 0.0))[0]:
                    best[name] = (tok_s, rate, share)
        uncapped.close()
        base = best["decode alone"][0]
        print(f"\n## {args.rows} decoding rows (default chat model), {args.tokens} tokens "
              "each, embedding requests kept coming back to back from a thread "
              f"(best of {args.repeats})")
        print("| load | rows' tok/s | ratio | embeddings sentences/s | engine time in encoder |")
        print("|---|---:|---:|---:|---:|")
        for name, (tok_s, rate, share) in best.items():
            embedded = f"{rate:.1f} | {share:.0%}" if rate else "- | -"
            print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f} | {embedded} |")
        print(f"\nrows' tokens unchanged by the embeddings: {unchanged}")


if __name__ == "__main__":
    main()
