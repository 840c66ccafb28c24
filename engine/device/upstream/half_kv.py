"""``EngineConfig(kv_dtype="float16")``: a float32 model (the CPU's) keeps its KV in float16.

Every cache kind allocates its arrays in the dtype of the keys and values it is handed
(mlx-lm's ``KVCache``, ``BatchKVCache``, the sliding window's ring, merges, extracts and the
prefix store's copies alike). So rather than a cache class of its own, each attention
layer's key and value projections return float16: keys are then turned (RoPE) and
stored in float16 by every cache kind, in the batch and out of it, and a row's KV is the
same bits whether it runs alone or batched. Queries stay float32; attention reads the
float16 cache in place (the CPU decode kernel casts the query and its output; MLX's own
attention, for prefill, widens the keys as it reads them). A key norm after the projection
writes float16 too (its float32 weight would widen the keys); an image row's prefill
through the vision library's language model gets the same (``has_half_kv``: the tower
installs it there), and the loader checks its warm-up forward's cache is float16.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.device.upstream.fast_ops import subclass_calling

_halved: dict[type, type] = {}  # projection class -> its float16-output subclass


def install_half_kv(model: Any) -> int:
    """Make every attention layer of ``model`` with its own ``k_proj`` and ``v_proj`` (and
    its ``k_norm``, if any) write float16 keys and values; returns the layers changed.
    ``ValueError`` when none has them (fused or latent projections: the setting cannot
    apply)."""
    changed = 0
    for _, module in model.named_modules():
        k_proj, v_proj = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if isinstance(k_proj, nn.Module) and isinstance(v_proj, nn.Module):
            # A key norm after the projection (Gemma 3, Qwen3) has float32 weights: its
            # output would widen the keys again, so it writes float16 too.
            k_norm = getattr(module, "k_norm", None)
            for part in (k_proj, v_proj, k_norm):
                if isinstance(part, nn.Module) and type(part) not in _halved.values():
                    part.__class__ = _half_class(type(part))
            changed += 1
    if not changed:
        raise ValueError(f"kv_dtype='float16' needs attention layers with their own k_proj "
                         f"and v_proj; {type(model).__module__} has none (fused or latent "
                         f"projections)")
    return changed


def has_half_kv(model: Any) -> bool:
    """Whether ``install_half_kv`` made ``model``'s attention write float16 KV."""
    return any(type(getattr(module, "k_proj", None)) in _halved.values()
               for _, module in model.named_modules())


def _half_class(cls: type) -> type:
    """A subclass of a projection class whose output is float16."""
    found = _halved.get(cls)
    if found is not None:
        return found

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return cls.__call__(self, *args, **kwargs).astype(mx.float16)

    halved = subclass_calling(cls, __call__)
    _halved[cls] = halved
    return halved
