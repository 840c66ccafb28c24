"""A quantized KV cache that mlx-lm's ``BatchGenerator`` can batch.

mlx-lm 0.32 has ``QuantizedKVCache`` for one request (keys and values stored as the
``(packed, scales, biases)`` triples ``mx.quantize`` makes along the head dim) and
``BatchKVCache`` for the batch (float keys, left padding), but no batch of quantized
rows: ``QuantizedKVCache`` has no ``merge``, so the generator's ``_merge_caches`` refuses
it (mlx-lm#1583). This module is the missing pair:

- ``RowQuantizedKVCache``: one row, ``QuantizedKVCache``'s semantics (it subclasses it,
  so mlx-lm's ``isinstance`` checks still hold), plus ``size``, a ``merge`` the generator
  calls to batch rows, and ``from_float`` for a float ``KVCache`` resumed from elsewhere;
- ``BatchQuantizedKVCache``: ``BatchKVCache``'s every method on the triples. Quantization
  runs along the head dim only, so every token's triple is independent of its
  neighbours: slicing, padding, rolling and concatenating along the sequence axis apply
  to the three arrays alike, and a row's stored tokens are bit-identical whether it runs
  alone or in a batch. The batch carries ``bits`` and ``group_size``, so mlx-lm's
  ``scaled_dot_product_attention`` takes its quantized path (quantized matmuls, no float
  copy of the cache);
- ``quantized_prompt_cache``: a row's cache list with each plain ``KVCache`` layer
  replaced by a ``RowQuantizedKVCache``.

One departure from ``QuantizedKVCache``: scales and biases of float32 keys are stored in
float16 (``scales_dtype``). mlx-lm stores them in the keys' dtype; on a float32 model
that is 64 bits of overhead per group, which at group size 64 makes 8-bit keys 0.28x of
float32 rather than 0.27x (4-bit 0.16x rather than 0.14x). ``mx.quantized_matmul``
takes float16 scales beside float32 queries; the rounding adds at most ~1/8 of a
quantization step. Pass ``scales_dtype=mx.float32`` for mlx-lm's own layout.

The head dim must be a multiple of ``group_size`` (``mx.quantize``'s rule): a model with
64-wide heads takes group size 64 or 32, one with 32-wide heads 32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

# (packed uint32, scales, biases): what ``mx.quantize`` returns, each (B, H, L, width).
Triple = tuple[mx.array, mx.array, mx.array]

# Buffers grow in steps of this many tokens, as mlx-lm's caches do: one reallocation per
# 256 decoded tokens rather than one per token.
STEP = 256


def stored_scales_dtype(keys_dtype: mx.Dtype, scales_dtype: mx.Dtype | None) -> mx.Dtype:
    """The dtype scales and biases are stored in: ``scales_dtype`` when given, else
    float16 for float32 keys (half the overhead; see the module's note) and the keys' own
    16-bit dtype otherwise."""
    if scales_dtype is not None:
        return scales_dtype
    return mx.float16 if keys_dtype == mx.float32 else keys_dtype


def quantize(x: mx.array, bits: int, group_size: int, scales_dtype: mx.Dtype | None) -> Triple:
    """``x`` (…, head_dim) quantized along its last axis, scales and biases stored as
    ``stored_scales_dtype`` says."""
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    dtype = stored_scales_dtype(x.dtype, scales_dtype)
    return packed, scales.astype(dtype), biases.astype(dtype)


def _slice_seq(triple: Triple, start: int | None, stop: int | None) -> Triple:
    """Each array of ``triple`` cut to ``[start:stop]`` on the sequence axis."""
    return triple[0][..., start:stop, :], triple[1][..., start:stop, :], \
        triple[2][..., start:stop, :]


def _grown(triple: Triple | None, like: Triple, used: int, needed: int) -> Triple:
    """A buffer holding ``triple``'s first ``used`` tokens with room for ``needed`` tokens
    in all, grown in whole steps; ``like`` (the incoming tokens) gives the shapes and
    dtypes of an empty one."""
    steps = (STEP + needed - used - 1) // STEP
    rows, heads = like[0].shape[0], like[0].shape[1]
    fresh = tuple(mx.zeros((rows, heads, steps * STEP, part.shape[-1]), dtype=part.dtype)
                  for part in like)
    if triple is None:
        return fresh  # type: ignore[return-value]
    if used % STEP != 0:  # drop the unused tail of the last step before growing
        triple = _slice_seq(triple, None, used)
    return tuple(mx.concatenate([old, new], axis=2)  # type: ignore[return-value]
                 for old, new in zip(triple, fresh, strict=True))


def _nbytes(*triples: Triple | None) -> int:
    return sum(part.nbytes for triple in triples if triple is not None for part in triple)


def _deepcopy(cache: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of ``cache`` sharing its ``mx.Dtype`` fields: mlx-lm's generator deep
    copies a prefill batch's cache when it splits the batch, and a ``Dtype`` neither
    pickles nor copies."""
    klass: Any = type(cache)
    twin = klass.__new__(klass)
    memo[id(cache)] = twin
    for name, value in vars(cache).items():
        setattr(twin, name, value if isinstance(value, mx.Dtype)
                else copy.deepcopy(value, memo))
    return twin


class RowQuantizedKVCache(QuantizedKVCache):  # type: ignore[misc]
    """One row's quantized KV cache: mlx-lm's ``QuantizedKVCache``, with scales stored
    as ``stored_scales_dtype`` says, a ``size``, and ``merge`` into the batch cache."""

    keys: Triple | None
    values: Triple | None
    # A class default too: ``from_state`` (mlx-lm's) builds rows without ``__init__``.
    scales_dtype: mx.Dtype | None = None

    def __init__(self, group_size: int = 64, bits: int = 8,
                 scales_dtype: mx.Dtype | None = None) -> None:
        super().__init__(group_size=group_size, bits=bits)
        self.scales_dtype = scales_dtype

    @classmethod
    def from_float(cls, cache: KVCache, bits: int = 8, group_size: int = 64,
                   scales_dtype: mx.Dtype | None = None) -> RowQuantizedKVCache:
        """A float ``KVCache`` (one row) quantized: its first ``offset`` tokens, each one
        exactly as ``update_and_fetch`` would have stored it (quantization is per token)."""
        row = cls(group_size=group_size, bits=bits, scales_dtype=scales_dtype)
        if cache.keys is not None and cache.offset > 0:
            row.update_and_fetch(cache.keys[..., :cache.offset, :],
                                 cache.values[..., :cache.offset, :])
        return row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        """Store ``keys`` and ``values`` (B, heads, steps, head_dim) quantized; return the
        whole cache's triples (what mlx-lm's quantized attention reads)."""
        prev, steps = self.offset, keys.shape[2]
        new_keys = quantize(keys, self.bits, self.group_size, self.scales_dtype)
        new_values = quantize(values, self.bits, self.group_size, self.scales_dtype)
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            self.keys = _grown(self.keys, new_keys, prev, prev + steps)
            self.values = _grown(self.values, new_values, prev, prev + steps)
        assert self.keys is not None and self.values is not None
        self.offset += steps
        for stored, new in ((self.keys, new_keys), (self.values, new_values)):
            for part, fresh in zip(stored, new, strict=True):
                part[..., prev:self.offset, :] = fresh
        return self.keys_and_values()  # type: ignore[no-any-return]

    def empty_like(self) -> RowQuantizedKVCache:
        """An empty row cache quantized as this one is."""
        return type(self)(group_size=self.group_size, bits=self.bits,
                          scales_dtype=self.scales_dtype)

    def map_keys(self, change: Callable[[mx.array], mx.array], upto: int) -> None:
        """Replace the first ``upto`` keys by ``change`` of them (float32, (B, heads, upto,
        head_dim)), quantized again: an image row's keys turned to other positions."""
        if self.keys is None or not upto:
            return
        held = _slice_seq(self.keys, 0, upto)
        keys = mx.dequantize(*held, group_size=self.group_size, bits=self.bits)
        fresh = quantize(change(keys.astype(mx.float32)), self.bits, self.group_size,
                         self.scales_dtype)
        for part, new in zip(self.keys, fresh, strict=True):
            part[..., :upto, :] = new.astype(part.dtype)

    def cut(self, n: int, *, copy: bool = False) -> RowQuantizedKVCache:
        """A new row cache holding this one's first ``n`` tokens: views of its arrays, or
        (``copy``) contiguous copies sized to them."""
        out = self.empty_like()
        if self.keys is not None and self.values is not None and n:
            keys, values = _slice_seq(self.keys, 0, n), _slice_seq(self.values, 0, n)
            if copy:
                keys = (mx.contiguous(keys[0]), mx.contiguous(keys[1]), mx.contiguous(keys[2]))
                values = (mx.contiguous(values[0]), mx.contiguous(values[1]),
                          mx.contiguous(values[2]))
            out.keys, out.values, out.offset = keys, values, n
        return out

    def size(self) -> int:
        """Tokens held (mlx-lm's ``QuantizedKVCache`` leaves ``size`` at 0, which its
        batch merge would read as empty)."""
        return int(self.offset)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (mlx-lm's own raises on an empty cache)."""
        return _nbytes(self.keys, self.values)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """The rows batched: what mlx-lm's generator calls on a row's layer."""
        return BatchQuantizedKVCache.merge(caches)

    def __deepcopy__(self, memo: dict[int, Any]) -> RowQuantizedKVCache:
        return _deepcopy(self, memo)  # type: ignore[no-any-return]


class BatchQuantizedKVCache:
    """mlx-lm's ``BatchKVCache`` on ``(packed, scales, biases)`` triples: rows left
    padded (``left_padding``), ``offset`` each row's position, ``_idx`` the filled length
    of the buffers shared by every row."""

    step = STEP

    def __init__(self, left_padding: Sequence[int], bits: int = 8, group_size: int = 64,
                 scales_dtype: mx.Dtype | None = None) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        # ``bits`` is what sends mlx-lm's attention down its quantized path.
        self.bits = bits
        self.group_size = group_size
        self.scales_dtype = scales_dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        """Store a step's keys and values (B, heads, steps, head_dim) quantized, at the
        same place in every row; return the filled triples."""
        prev, steps = self._idx, keys.shape[2]
        new_keys = quantize(keys, self.bits, self.group_size, self.scales_dtype)
        new_values = quantize(values, self.bits, self.group_size, self.scales_dtype)
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            self.keys = _grown(self.keys, new_keys, prev, prev + steps)
            self.values = _grown(self.values, new_values, prev, prev + steps)
        assert self.values is not None
        self.offset = self.offset + steps
        self._idx += steps
        for stored, new in ((self.keys, new_keys), (self.values, new_values)):
            for part, fresh in zip(stored, new, strict=True):
                part[..., prev:self._idx, :] = fresh
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        """The triples cut to the filled length."""
        assert self.keys is not None and self.values is not None
        return _slice_seq(self.keys, None, self._idx), _slice_seq(self.values, None, self._idx)

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """Before a right-padded prefill: note the padding ``finalize`` rolls to the left
        (and, on an empty cache, more left padding)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty "
                                 "BatchQuantizedKVCache")
            pad = mx.array(list(left_padding))
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's pad tokens round to its left,
        where the mask hides them (the rows then all end at ``_idx``)."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        shifts = padding[:, None]
        assert self.keys is not None and self.values is not None
        self.keys = tuple(dynamic_roll(part, shifts, axis=2) for part in self.keys)
        self.values = tuple(dynamic_roll(part, shifts, axis=2) for part in self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        """What evaluating the cache needs (the generator ``mx.eval``s it)."""
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens of every row; the number forgotten."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False,
                  **kwargs: Any) -> mx.array:
        """The causal mask with each row's left padding hidden."""
        mask: mx.array = create_causal_mask(N, offset=self._idx,
                                            left_padding=self.left_padding, **kwargs)
        return mask

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep only these rows (in this order), then drop the padding every row shares."""
        if self.keys is not None and self.values is not None:
            self.keys = tuple(part[batch_indices]  # type: ignore[assignment]
                              for part in self.keys)
            self.values = tuple(part[batch_indices]  # type: ignore[assignment]
                                for part in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = int(cast(int, mx.min(self.left_padding).item()))
        if shared > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _slice_seq(self.keys, shared, None)
                self.values = _slice_seq(self.values, shared, None)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def _layout(self, other: BatchQuantizedKVCache) -> tuple[Triple, Triple]:
        """Zero-length triples shaped like the filled side's (packed widths differ from
        the head dim: ``head_dim * bits / 32``)."""
        filled = self if self.keys is not None else other
        assert filled.keys is not None and filled.values is not None
        return filled.keys, filled.values

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows: both right-aligned to the longer filled length."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like_keys, like_values = self._layout(other)
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def empty_like(triple: Triple, rows: int) -> Triple:
            return tuple(mx.zeros((rows, part.shape[1], 0, part.shape[3]),  # type: ignore
                                  dtype=part.dtype) for part in triple)

        def pad(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            rows = c.offset.shape[0]
            keys = c.keys if c.keys is not None else empty_like(like_keys, rows)
            values = c.values if c.values is not None else empty_like(like_values, rows)
            left = max_idx - c._idx
            right = max_size - keys[0].shape[2] - left
            if right < 0:
                keys, values = _slice_seq(keys, None, right), _slice_seq(values, None, right)
                right = 0
            if left or right:
                width = [(0, 0), (0, 0), (left, right), (0, 0)]
                keys = tuple(mx.pad(part, width) for part in keys)  # type: ignore[assignment]
                values = tuple(mx.pad(part, width)  # type: ignore[assignment]
                               for part in values)
            return keys, values, c.offset, c.left_padding + left

        mine, theirs = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b])  # type: ignore[assignment]
                          for a, b in zip(mine[0], theirs[0], strict=True))
        self.values = tuple(mx.concatenate([a, b])  # type: ignore[assignment]
                            for a, b in zip(mine[1], theirs[1], strict=True))
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = max_idx

    def extract(self, idx: int) -> RowQuantizedKVCache:
        """Row ``idx`` as a cache of its own, its padding cut off (copies, not views)."""
        row = RowQuantizedKVCache(group_size=self.group_size, bits=self.bits,
                                  scales_dtype=self.scales_dtype)
        if self.keys is None or self.values is None:
            return row
        mx.eval(self.left_padding)
        padding = int(cast(int, self.left_padding[idx].item()))
        row.keys = tuple(mx.contiguous(part[idx:idx + 1, :, padding:self._idx])
                         for part in self.keys)  # type: ignore[assignment]
        row.values = tuple(mx.contiguous(part[idx:idx + 1, :, padding:self._idx])
                           for part in self.values)  # type: ignore[assignment]
        row.offset = self._idx - padding
        return row

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """Rows batched, each left padded to the longest. Rows are ``RowQuantizedKVCache``s
        of one ``bits`` and ``group_size``; a float ``KVCache`` among them (resumed from
        elsewhere) is quantized on the way in."""
        quantized = [c for c in caches if isinstance(c, RowQuantizedKVCache)]
        if not quantized:
            raise ValueError("BatchQuantizedKVCache.merge needs a RowQuantizedKVCache row")
        first = quantized[0]
        settings = {(c.bits, c.group_size, str(c.scales_dtype)) for c in quantized}
        if len(settings) > 1:
            raise ValueError(f"rows quantized differently cannot share a batch: {settings}")
        rows: list[RowQuantizedKVCache] = []
        for c in caches:
            if isinstance(c, RowQuantizedKVCache):
                rows.append(c)
            elif type(c) is KVCache:
                rows.append(RowQuantizedKVCache.from_float(
                    c, first.bits, first.group_size, first.scales_dtype))
            else:
                raise TypeError(f"cannot batch a {type(c).__name__} with quantized rows")
        lengths = [row.size() for row in rows]
        longest = max(lengths)
        padding = [longest - length for length in lengths]
        batch = cls(padding, bits=first.bits, group_size=first.group_size,
                    scales_dtype=first.scales_dtype)
        if longest == 0:
            return batch
        filled = next(row for row in rows if row.keys is not None and row.size() > 0)
        assert filled.keys is not None and filled.values is not None

        def gathered(pick: int, triple_of: str) -> mx.array:
            like = getattr(filled, triple_of)[pick]
            out = mx.zeros((len(rows), like.shape[1], longest, like.shape[3]), dtype=like.dtype)
            for i, (pad, row) in enumerate(zip(padding, rows, strict=True)):
                if row.size() > 0:
                    out[i:i + 1, :, pad:] = getattr(row, triple_of)[pick][..., :row.offset, :]
            return out

        batch.keys = tuple(gathered(p, "keys") for p in range(3))  # type: ignore[assignment]
        batch.values = tuple(gathered(p, "values") for p in range(3))  # type: ignore
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def __deepcopy__(self, memo: dict[int, Any]) -> BatchQuantizedKVCache:
        return _deepcopy(self, memo)  # type: ignore[no-any-return]

    def size(self) -> int:
        """The filled length of the buffers (the longest row's tokens)."""
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers, packed values, scales and biases, as allocated."""
        return _nbytes(self.keys, self.values)


def quantized_prompt_cache(model: Any, bits: int = 8, group_size: int = 64,
                           scales_dtype: mx.Dtype | None = None) -> list[Any]:
    """A row's cache for ``model`` (``make_prompt_cache``'s) with each plain ``KVCache``
    layer quantized; other kinds (sliding windows, recurrent state) as they are."""
    return [RowQuantizedKVCache(group_size=group_size, bits=bits, scales_dtype=scales_dtype)
            if type(layer) is KVCache else layer for layer in make_prompt_cache(model)]


def install_quantized_kv(model: Any, bits: int, group_size: int) -> None:
    """Make every row cache built for ``model`` (``make_prompt_cache``: the lanes', the
    generator's, an image row's) quantize its plain KV layers; other kinds are kept.
    ``ValueError`` when ``group_size`` does not divide the model's head size."""
    base = getattr(model, "make_cache", None)

    def plain() -> list[Any]:
        return list(base()) if base is not None else [KVCache() for _ in model.layers]

    def make_cache() -> list[Any]:
        return [RowQuantizedKVCache(group_size=group_size, bits=bits)
                if type(layer) is KVCache else layer for layer in plain()]

    for layer in plain():
        if type(layer) is KVCache:
            head = _head_size(model)
            if head is not None and head % group_size:
                raise ValueError(f"kv_group_size={group_size} does not divide the model's "
                                 f"head size {head}: pick one that does (32, 64, 128)")
            break
    model.make_cache = make_cache


def _head_size(model: Any) -> int | None:
    """The model's attention head size, where its args say."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if source is None:
            continue
        found = source.get("head_dim") if isinstance(source, dict) else getattr(
            source, "head_dim", None)
        if found:
            return int(found)
        hidden = (source.get("hidden_size") if isinstance(source, dict)
                  else getattr(source, "hidden_size", None))
        heads = (source.get("num_attention_heads") if isinstance(source, dict)
                 else getattr(source, "num_attention_heads", None))
        if hidden and heads:
            return int(hidden) // int(heads)
    return None
