"""What quantized KV costs in quality, on the default model: perplexity over a fixed public-
domain text (bench/data/declaration_of_independence.txt: the Declaration of Independence and
the Gettysburg Address, ~2,000 tokens) and top-1 agreement with float32 over 32 prompts x 256
tokens, for KV in float32, float16, 8 bits and 4 bits, and what 4 bits might need: keys
(and values) rotated by a Hadamard matrix first, as llama.cpp and QuaRot do, groups of 32,
or keys kept in 8 bits.

Every setting reads the same tokens through the model with its KV cache, a chunk at a time,
so each position attends to the cache as a decode step would. float32 and the quantized
widths use the engine's own caches (``RowQuantizedKVCache``, what ``EngineConfig.kv_bits``
runs); the other settings round the stored values as such a cache would (quantize then
dequantize, rotated and back) and attend in float32. "float16 (kv_dtype)" is what
``EngineConfig(kv_dtype="float16")`` runs: keys and values projected, turned and kept in
float16 (``install_half_kv``, read last: it changes the model for good). Agreement is
teacher-forced: float32 writes each continuation greedily (the engine, 32 rows in one
batch), then every setting reads it back, and a position agrees where its next-token choice
equals float32's.

    python bench/kv_quality.py [--prompts 32] [--tokens 256] [--chunk 16]
        [--settings float32 "float16 (kv_dtype)" ...]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig, SamplingParams, TextRequest
from engine.device.upstream.half_kv import install_half_kv
from engine.device.upstream.quantized_kv import RowQuantizedKVCache

TEXT = Path(__file__).with_name("data") / "declaration_of_independence.txt"
TOPICS = ["rivers", "volcanoes", "tea", "owls", "trains", "glass", "maps", "bees", "salt",
          "clocks", "kites", "moss", "bridges", "ink", "wolves", "comets"]


class RoundedKVCache(KVCache):  # type: ignore[misc]
    """Plain KV whose stored keys and values are rounded as a storage format would keep
    them (``store``: float16, or quantize-dequantize with an optional rotation)."""

    def __init__(self, store: Callable[[mx.array, bool], mx.array]) -> None:
        super().__init__()
        self._store = store

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fetched: tuple[mx.array, mx.array] = super().update_and_fetch(
            self._store(keys, True), self._store(values, False))
        return fetched


def hadamard(n: int) -> mx.array:
    """The n x n Hadamard matrix scaled to be orthonormal (n a power of two)."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / math.sqrt(n), dtype=mx.float32)


def fake_quant(bits: int, group: int, rotate: str = "",
               value_bits: int | None = None) -> Callable[[mx.array, bool], mx.array]:
    """Quantize-dequantize: the values attention reads from a cache stored that way.
    ``rotate``: "K" or "KV", rotated by a Hadamard matrix before and back after;
    ``value_bits``: values in another width than keys."""
    def store(x: mx.array, is_key: bool) -> mx.array:
        width = bits if is_key or value_bits is None else value_bits
        h = hadamard(x.shape[-1]) if ("K" if is_key else "V") in rotate else None
        y = x @ h if h is not None else x
        q = mx.dequantize(*mx.quantize(y, group_size=group, bits=width), group_size=group,
                          bits=width)
        return q @ h.T if h is not None else q
    return store


SETTINGS = ["float32", "float16", "8-bit", "4-bit", "4-bit, K rotated", "4-bit, groups of 32",
            "4-bit, groups of 32, K and V rotated", "keys 8-bit, values 4-bit",
            "float16 (kv_dtype)"]


def caches(model: Any, setting: str, group: int) -> list[Any]:
    layers = len(model.layers)
    if setting == "float32":
        return [KVCache() for _ in range(layers)]
    if setting == "float16 (kv_dtype)":  # the model's projections write float16 (installed)
        return [KVCache() for _ in range(layers)]
    if setting == "float16":
        return [RoundedKVCache(lambda x, _: x.astype(mx.float16).astype(x.dtype))
                for _ in range(layers)]
    if setting in ("8-bit", "4-bit"):
        return [RowQuantizedKVCache(group_size=group, bits=int(setting[0]))
                for _ in range(layers)]
    simulated = {"4-bit, K rotated": fake_quant(4, group, "K"),
                 "4-bit, groups of 32": fake_quant(4, 32),
                 "4-bit, groups of 32, K and V rotated": fake_quant(4, 32, "KV"),
                 "keys 8-bit, values 4-bit": fake_quant(8, group, value_bits=4)}
    return [RoundedKVCache(simulated[setting]) for _ in range(layers)]


def read(model: Any, tokens: list[int], setting: str, group: int, chunk: int) -> mx.array:
    """Log-probabilities (len(tokens) - 1, vocab) of each next token, read a chunk at a
    time through a cache of ``setting``."""
    cache = caches(model, setting, group)
    out = []
    for start in range(0, len(tokens) - 1, chunk):
        piece = mx.array([tokens[start:min(start + chunk, len(tokens) - 1)]])
        logits = model(piece, cache=cache)[0].astype(mx.float32)
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=0)


def perplexity(model: Any, tokens: list[int], setting: str, group: int, chunk: int) -> float:
    logprobs = read(model, tokens, setting, group, chunk)
    picked = mx.take_along_axis(logprobs, mx.array(tokens[1:])[:, None], axis=1)
    return math.exp(-float(mx.mean(picked)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--settings", nargs="+", default=SETTINGS,
                        help="float32 first (the reference); float16 (kv_dtype) last")
    args = parser.parse_args()
    settings = args.settings
    with Engine(args.model, EngineConfig(max_batch=args.prompts, speculation=0)) as eng:
        eng.start()
        tokenizer = eng.tokenizer
        text = list(tokenizer.encode(TEXT.read_text(), add_special_tokens=False))
        prompts = [list(tokenizer.encode(f"Here is a short essay about {TOPICS[i % 16]}, part "
                                         f"{i // 16 + 1}.\n\n", add_special_tokens=False))
                   for i in range(args.prompts)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
        handles = [eng.submit(TextRequest(tuple(p), params)) for p in prompts]
        written = [p + list(h.result().token_ids) for p, h in zip(prompts, handles)]
        composition = eng._runtime.composition
        assert composition is not None
        model = composition.built.model.model  # the loaded model, its KV as each setting
        rows = []
        reference: list[mx.array] = []
        for setting in settings:
            if setting == "float16 (kv_dtype)":
                install_half_kv(model)
            started = time.perf_counter()
            ppl = perplexity(model, text, setting, args.group, args.chunk)
            agree = total = 0
            for i, sequence in enumerate(written):
                choice = mx.argmax(read(model, sequence, setting, args.group, args.chunk),
                                   axis=-1)
                if setting == "float32":
                    reference.append(choice)
                span = slice(len(prompts[i]) - 1, None)  # the continuation's positions
                agree += int(mx.sum(choice[span] == reference[i][span]))
                total += int(choice[span].size)
            rows.append((setting, ppl, agree / total, time.perf_counter() - started))
    base = rows[0][1]
    print(f"model: {eng.model_path}; text {len(text)} tokens; {args.prompts} prompts x "
          f"{args.tokens} tokens; groups of {args.group}; chunks of {args.chunk}\n")
    print("| KV | perplexity | vs float32 | top-1 agreement with float32 | s |")
    print("|---|---:|---:|---:|---:|")
    for setting, ppl, agreement, seconds in rows:
        print(f"| {setting} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | "
              f"{100 * agreement:.2f}% | {seconds:.0f} |")


if __name__ == "__main__":
    main()
