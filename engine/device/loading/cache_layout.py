"""Describe mlx-lm cache objects as pure ``LayerFootprint`` records.

ONE protocol: an adapter takes a cache layer that has seen one token and returns its
footprint(s). A new cache type needs one adapter registered here, nothing in the
scheduler. Batchability is whether mlx-lm can merge the class into a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from engine.core.footprint import LayerFootprint
from engine.device.upstream.quantized_kv import RowQuantizedKVCache

CacheAdapter = Callable[[Any], list[LayerFootprint]]


def _nbytes(arrays: Sequence[Any]) -> int:
    total = 0
    for item in arrays:
        if isinstance(item, mx.array):
            total += item.nbytes
        elif isinstance(item, tuple | list):
            total += _nbytes(item)
    return total


def _per_token(keys: Any, values: Any) -> int:
    # Buffers are allocated in steps; divide by the allocated length, not the offset.
    first = keys[0] if isinstance(keys, tuple | list) else keys
    allocated = int(first.shape[-2])
    return _nbytes([keys, values]) // max(allocated, 1)


def _kv(cache: Any) -> list[LayerFootprint]:
    return [LayerFootprint("KVCache", True, bytes_per_token=_per_token(cache.keys, cache.values))]


def _rotating(cache: Any) -> list[LayerFootprint]:
    per_token = _per_token(cache.keys, cache.values)
    window = int(cache.max_size)
    return [LayerFootprint("RotatingKVCache", True, bytes_per_token=per_token, window=window)]


def _quantized(cache: Any) -> list[LayerFootprint]:
    # mlx-lm cannot merge quantized KV caches into a batch: these rows run serially.
    per_token = _per_token(cache.keys, cache.values)
    return [LayerFootprint("QuantizedKVCache", False, bytes_per_token=per_token)]


def _row_quantized(cache: Any) -> list[LayerFootprint]:
    # The engine's own quantized rows (``EngineConfig.kv_bits``): they batch.
    per_token = _per_token(cache.keys, cache.values)
    return [LayerFootprint(f"KVCache({cache.bits}-bit)", True, bytes_per_token=per_token)]


def _arrays(cache: Any) -> list[LayerFootprint]:
    # Recurrent (SSM) state: a fixed size whatever the sequence length.
    return [LayerFootprint("ArraysCache", True, fixed_bytes=_nbytes(cache.cache))]


def _cache_list(cache: Any) -> list[LayerFootprint]:
    return [fp for child in cache.caches for fp in footprint_of(child)]


def _unknown(cache: Any) -> list[LayerFootprint]:
    # Conservative: count everything it holds after one token as per-token bytes.
    batchable = hasattr(type(cache), "merge")
    return [LayerFootprint(type(cache).__name__, batchable, bytes_per_token=int(cache.nbytes))]


ADAPTERS: dict[type, CacheAdapter] = {
    mlx_cache.KVCache: _kv,
    mlx_cache.RotatingKVCache: _rotating,
    mlx_cache.QuantizedKVCache: _quantized,
    RowQuantizedKVCache: _row_quantized,
    mlx_cache.ArraysCache: _arrays,
    mlx_cache.CacheList: _cache_list,
}


def footprint_of(cache: Any) -> list[LayerFootprint]:
    """Footprint records for one cache layer (most specific registered class wins)."""
    for klass in type(cache).__mro__:
        adapter = ADAPTERS.get(klass)
        if adapter is not None:
            return adapter(cache)
    return _unknown(cache)
