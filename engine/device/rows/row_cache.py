"""A row's own cache, whatever its layers hold: batch it, cut it back, copy it, roll it back.

mlx-lm gives a model one cache object per layer, of several kinds:

- ``KVCache``: every key and value so far; it can be cut back to any earlier length.
- ``RotatingKVCache`` (sliding-window attention): the last ``max_size`` keys in a ring.
  Before the ring wraps it holds every token, so it cuts back like a ``KVCache``; after,
  the keys a shorter prefix needs are gone.
- ``ArraysCache`` (SSM, linear attention, short convolutions): a fixed-size state of the
  whole sequence; no earlier state can be recovered from it.
- ``CacheList``: several of the above for one layer.

The engine needs five things from a row's cache, on every kind: merge rows into one batch
for a forward (``merged``), take a row back out (``extracted``), hold the state of a
prefix (``cut_to``, exact where the cache cannot be cut back), keep a copy that later
updates cannot reach (``copied``), and undo tokens a forward fed that turned out wrong
(``Rollback``: drafts the model rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, RotatingKVCache

from engine.device.upstream.quantized_kv import RowQuantizedKVCache


def merged(rows: Sequence[Sequence[Any]]) -> list[Any]:
    """One batch cache per layer from several rows' own caches (mlx-lm's own merge:
    ``BatchKVCache``, ``BatchRotatingKVCache``, a batched ``ArraysCache``...)."""
    return [type(rows[0][i]).merge([row[i] for row in rows]) for i in range(len(rows[0]))]


def extracted(layers: Sequence[Any], index: int) -> list[Any]:
    """Row ``index``'s own cache out of batch caches."""
    return [layer.extract(index) for layer in layers]


def rows_after_chunk(layers: Sequence[Any], right_padding: Sequence[int]) -> list[list[Any]]:
    """Each row's own cache out of batch caches that just took a right-padded chunk.

    mlx-lm's ``finalize`` rolls every row's padding to the left (a gather over the whole
    cache, a fifth of a span forward's time on a CPU); rows leaving the batch at once
    need no roll: a plain KV layer's row is sliced between its left padding and its
    right padding. Other kinds finalize as mlx-lm does, then extract."""
    rows: list[list[Any]] = [[] for _ in right_padding]
    for layer in layers:
        if type(layer) is BatchKVCache and layer.keys is not None:
            left = layer.left_padding.tolist()
            for i, pad in enumerate(right_padding):
                row = KVCache()
                end = layer._idx - pad
                row.keys = mx.contiguous(layer.keys[i:i + 1, :, left[i]:end])
                row.values = mx.contiguous(layer.values[i:i + 1, :, left[i]:end])
                row.offset = end - left[i]
                rows[i].append(row)
            continue
        layer.finalize()
        for i in range(len(right_padding)):
            rows[i].append(layer.extract(i))
    return rows


def tokens_held(cache: Sequence[Any]) -> int:
    """How many tokens the cache has seen (state caches do not say: the caller knows)."""
    return max((_offset(layer) for layer in cache), default=0)


def _offset(layer: Any) -> int:
    if isinstance(layer, KVCache | RotatingKVCache | RowQuantizedKVCache):
        return int(layer.offset)
    if isinstance(layer, CacheList):
        return tokens_held(layer.caches)
    return 0


def wrapped(layer: Any) -> bool:
    """A rotating cache that has dropped keys: it can no longer be cut back."""
    return isinstance(layer, RotatingKVCache) and (
        (layer.keys is not None and int(layer.offset) > int(layer.keys.shape[2]))
        or int(layer.offset) > int(layer.max_size))


def cuttable(cache: Sequence[Any]) -> bool:
    """Whether every layer can be cut back to any shorter length (plain KV, or a sliding
    window that has not wrapped)."""
    return all(_cuttable(layer) for layer in cache)


def _cuttable(layer: Any) -> bool:
    if isinstance(layer, CacheList):
        return cuttable(layer.caches)
    if isinstance(layer, RotatingKVCache):
        return not wrapped(layer) and layer.keep == 0
    return isinstance(layer, KVCache | RowQuantizedKVCache)


def cut_to(cache: Sequence[Any], n: int, held: int) -> list[Any] | None:
    """New cache objects holding the state after the first ``n`` of the ``held`` tokens the
    cache has seen, sharing the arrays (views) but never an array object, so nothing the
    new cache is fed reaches ``cache``. None when a layer cannot be cut back to ``n``
    (state, a wrapped window) unless ``n == held``."""
    out = [_cut(layer, n, held) for layer in cache]
    return None if any(layer is None for layer in out) else out


def _cut(layer: Any, n: int, held: int) -> Any:
    if isinstance(layer, RowQuantizedKVCache):
        return layer.cut(n)
    if isinstance(layer, KVCache):
        out = KVCache()
        if layer.keys is not None and n:
            out.keys = layer.keys[..., :n, :]
            out.values = layer.values[..., :n, :]
            out.offset = n
        return out
    if isinstance(layer, RotatingKVCache):
        if n != held and not _cuttable(layer):
            return None
        ring = RotatingKVCache(layer.max_size, layer.keep)
        if layer.keys is not None and n:
            keys, values = _temporal(layer)
            length = int(keys.shape[2]) - (held - n)  # keys in time order end at ``held``
            ring.keys, ring.values = keys[..., :length, :], values[..., :length, :]
            ring.offset, ring._idx = n, length
        return ring
    if isinstance(layer, ArraysCache):
        if n != held:
            return None
        state = ArraysCache(len(layer.cache))
        state.cache = list(layer.cache)  # models replace these arrays, never write into them
        return state
    if isinstance(layer, CacheList):
        children = [_cut(child, n, held) for child in layer.caches]
        return None if any(c is None for c in children) else CacheList(*children)
    return None


def _temporal(layer: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A ring's keys and values in time order, the valid ones only."""
    assert layer.keys is not None and layer.values is not None
    keys = layer._temporal_order(layer.keys)
    values = layer._temporal_order(layer.values)
    valid = min(int(layer.offset), int(keys.shape[2]))
    return keys[..., -valid:, :] if valid else keys[..., :0, :], (
        values[..., -valid:, :] if valid else values[..., :0, :])


def copied(cache: Sequence[Any]) -> list[Any]:
    """Exact-size copies of a cache's arrays, computed now (asynchronously).

    A lazy slice of a running batch's KV would keep that whole buffer alive and, while it
    is referenced, force every later in-place KV update of the batch to copy the buffer
    (measured: +40% decode step time at 16 rows). Copies sized to the tokens they hold
    also make the store's byte count what it really keeps alive.
    """
    layers = [_copied(layer) for layer in cache]
    mx.async_eval(arrays_of(layers))  # type: ignore[no-untyped-call]
    return layers


def _copied(layer: Any) -> Any:
    if isinstance(layer, RowQuantizedKVCache):
        return layer.cut(layer.offset, copy=True)
    if isinstance(layer, KVCache):
        out = KVCache()
        if layer.keys is not None:
            n = layer.offset
            out.keys = mx.contiguous(layer.keys[..., :n, :])
            out.values = mx.contiguous(layer.values[..., :n, :])
            out.offset = n
        return out
    if isinstance(layer, RotatingKVCache):
        ring = RotatingKVCache(layer.max_size, layer.keep)
        if layer.keys is not None:
            keys, values = _temporal(layer)
            ring.keys, ring.values = mx.contiguous(keys), mx.contiguous(values)
            ring.offset, ring._idx = int(layer.offset), int(keys.shape[2])
        return ring
    if isinstance(layer, ArraysCache):
        state = ArraysCache(len(layer.cache))
        state.cache = [None if a is None else mx.contiguous(a) for a in layer.cache]
        return state
    if isinstance(layer, CacheList):
        return CacheList(*(_copied(child) for child in layer.caches))
    return layer


def arrays_of(cache: Sequence[Any]) -> list[mx.array]:
    """Every array a cache holds (what evaluating or counting it touches)."""
    out: list[mx.array] = []
    for layer in cache:
        if isinstance(layer, RowQuantizedKVCache):
            out += [a for part in (layer.keys, layer.values) if part is not None for a in part]
        elif isinstance(layer, KVCache | RotatingKVCache):
            out += [a for a in (layer.keys, layer.values) if a is not None]
        elif isinstance(layer, ArraysCache):
            out += [a for a in layer.cache if a is not None]
        elif isinstance(layer, CacheList):
            out += arrays_of(layer.caches)
    return out


def nbytes(cache: Sequence[Any]) -> int:
    return sum(int(a.nbytes) for a in arrays_of(cache))


# ----- rolling back tokens a forward fed ---------------------------------------------------


def trims_exactly(cache: Sequence[Any]) -> bool:
    """Whether tokens fed by a multi-token forward can be taken back by trimming alone.

    Plain KV: always. A sliding window: yes, because a multi-token forward concatenates
    (``RotatingKVCache._update_concat``) and keeps the ``max_size - 1`` keys before the new
    tokens, which is what the window of the last kept token needs; ``trimmed`` then cuts
    the buffer to the kept tokens, so the ring goes on in time order. State caches: no,
    their state after fewer tokens is gone (see ``Rollback``).
    """
    return all(_trims(layer) for layer in cache)


def _trims(layer: Any) -> bool:
    if isinstance(layer, CacheList):
        return trims_exactly(layer.caches)
    return isinstance(layer, KVCache | RowQuantizedKVCache) or (
        isinstance(layer, RotatingKVCache) and layer.keep == 0)


def trimmed(cache: Sequence[Any], n: int) -> None:
    """Take back the last ``n`` tokens a multi-token forward fed (``trims_exactly``)."""
    if n <= 0:
        return
    for layer in cache:
        _trim(layer, n)


def _trim(layer: Any, n: int) -> None:
    if isinstance(layer, CacheList):
        for child in layer.caches:
            _trim(child, n)
        return
    layer.trim(n)
    if isinstance(layer, RotatingKVCache) and layer.keys is not None:
        # The buffer after a concatenating update is in time order; dropping the rejected
        # keys from its end keeps it so (a ring must never hold keys past ``_idx``).
        layer.keys = layer.keys[..., : layer._idx, :]
        layer.values = layer.values[..., : layer._idx, :]


@dataclass
class Rollback:
    """A cache's state before a forward, to return to when some fed tokens are rejected.

    Exact on every kind: KV layers are trimmed back to their offset, rings and state
    caches get their arrays back. A forward never writes into those arrays: state caches
    and a ring's multi-token update replace them, so holding them costs no copy.
    """

    layers: list[Any]

    @classmethod
    def of(cls, cache: Sequence[Any]) -> Rollback:
        return cls([_mark(layer) for layer in cache])

    def restore(self, cache: Sequence[Any]) -> None:
        for layer, mark in zip(cache, self.layers):
            _restore(layer, mark)


def _mark(layer: Any) -> Any:
    if isinstance(layer, KVCache | RowQuantizedKVCache):
        return layer.offset
    if isinstance(layer, RotatingKVCache):
        return (layer.keys, layer.values, layer.offset, layer._idx)
    if isinstance(layer, ArraysCache):
        return list(layer.cache)
    if isinstance(layer, CacheList):
        return [_mark(child) for child in layer.caches]
    raise TypeError(f"{type(layer).__name__} cannot be rolled back")


def _restore(layer: Any, mark: Any) -> None:
    if isinstance(layer, KVCache | RowQuantizedKVCache):
        layer.trim(layer.offset - mark)
    elif isinstance(layer, RotatingKVCache):
        layer.keys, layer.values, layer.offset, layer._idx = mark
    elif isinstance(layer, ArraysCache):
        layer.cache = list(mark)
    elif isinstance(layer, CacheList):
        for child, child_mark in zip(layer.caches, mark):
            _restore(child, child_mark)


def supported(cache: Sequence[Any]) -> bool:
    """Whether every layer is a kind this module handles (mlx-lm's own quantized KV,
    which no batch takes, is not; ``RowQuantizedKVCache`` is)."""
    return all(_supported(layer) for layer in cache)


def _supported(layer: Any) -> bool:
    if isinstance(layer, CacheList):
        return supported(layer.caches)
    return type(layer) in (KVCache, RotatingKVCache, ArraysCache, RowQuantizedKVCache)
