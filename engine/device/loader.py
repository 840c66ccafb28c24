"""Loading a model on the engine thread and building its lanes.

``load_model`` runs on the engine thread: it creates the thread's MLX stream, loads
weights and tokenizer, and probes the cache layout once (what the scheduler budgets
with). ``build_lanes`` makes the batch and serial lanes over the loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

from engine.config import EngineConfig
from engine.device.batch_lane import BatchLane
from engine.device.cache_layout import footprint_of
from engine.device.prefix_reuse import PrefixReuse, reuse_policy
from engine.device.sampling import SamplerCache
from engine.device.serial_lane import SerialLane
from engine.footprint import ModelFootprint
from engine.grammar import GrammarCompiler
from engine.models import config_context_limit
from engine.prefix_cache import PrefixStore


@dataclass
class LoadedModel:
    """Weights, tokenizer and what the engine learned about them at load time."""

    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    footprint: ModelFootprint
    stream: Any
    vocab_size: int


@dataclass
class Lanes:
    """The two places rows run, and the prefix store the batch lane fills."""

    batch: BatchLane
    serial: SerialLane
    store: PrefixStore

    @staticmethod
    def device_memory() -> tuple[int, int]:
        """MLX's allocator now: bytes in live arrays, bytes it keeps cached for reuse."""
        return int(mx.get_active_memory()), int(mx.get_cache_memory())


def load_model(path: Path, config: EngineConfig) -> LoadedModel:
    """Load on this (the engine) thread; every later MLX call must come from it too."""
    stream = mx.new_thread_local_stream(mx.default_device())
    model, tokenizer = mlx_load(str(path))[:2]
    cache = make_prompt_cache(model, config.max_kv_size)
    with mx.stream(stream):
        model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
    layers = [fp for layer in cache for fp in footprint_of(layer)]
    args = getattr(model, "args", None)
    vocab = int(args.vocab_size) if args is not None else len(tokenizer)
    footprint = ModelFootprint.of(layers, config_context_limit(path))
    return LoadedModel(model, tokenizer, footprint, stream, vocab)


def build_lanes(loaded: LoadedModel, config: EngineConfig, compiler: GrammarCompiler) -> Lanes:
    samplers = SamplerCache()
    store = PrefixStore(config.prefix_cache_bytes, config.prefix_cache_ttl,
                        min_tokens=config.prefix_min_tokens)
    reuse = PrefixReuse(store, reuse_policy(loaded.footprint))
    batch = BatchLane(loaded.model, loaded.stream, compiler, samplers, reuse,
                      max_batch=config.max_batch, prefill_batch=config.prefill_batch,
                      prefill_chunk=config.prefill_chunk, max_kv_size=config.max_kv_size)
    serial = SerialLane(loaded.model, loaded.stream, compiler, samplers, config.max_kv_size,
                        config.prefill_chunk)
    return Lanes(batch, serial, store)


def release_streams() -> None:
    """Called last on the engine thread: without it processes aborted at exit."""
    mx.clear_streams()
