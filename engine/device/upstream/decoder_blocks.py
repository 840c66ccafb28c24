"""mlx-lm's decoder blocks whose forward is llama's, for the CPU kernels' decode layer.

A llama-shaped block computes ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``, its
attention projecting q/k/v, turning q and k with ``rope`` at ``cache.offset``, updating the
cache, attending and projecting with ``o_proj``; its MLP is ``down(swiglu(gate(x), up(x)))``.
``kernels.decode_layer`` computes that forward in two kernel ops at one query a row; it
takes a block only where this module names its class, and gives it a class whose
``__call__`` is the kernel's (the original stays the fallback).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from engine.device.upstream.fast_ops import subclass_calling

# Block classes (module, name) whose __call__, attention and MLP are llama's, as above
# (Qwen2's q/k/v add a bias; Qwen3's q and k take an RMSNorm per head before RoPE).
LLAMA_SHAPED: tuple[tuple[str, str], ...] = (("mlx_lm.models.llama", "TransformerBlock"),
                                             ("mlx_lm.models.qwen2", "TransformerBlock"),
                                             ("mlx_lm.models.qwen3", "TransformerBlock"))


@dataclass(frozen=True)
class RopeForm:
    """What a block's ``rope`` hands ``mx.fast.rope``: its base, or its own frequencies."""

    dims: int
    traditional: bool
    base: float
    scale: float
    freqs: Any = None  # mx.array of dims / 2 frequencies, where the class keeps them


def rope_form(rope: Any) -> RopeForm | None:
    """The form of ``nn.RoPE`` or mlx-lm's ``Llama3RoPE``; None for other RoPE classes."""
    cls = type(rope)
    if cls is nn.RoPE and rope.base is not None:
        return RopeForm(rope.dims, rope.traditional, float(rope.base), float(rope.scale))
    if (cls.__module__, cls.__qualname__) == ("mlx_lm.models.rope_utils", "Llama3RoPE"):
        return RopeForm(rope.dims, rope.traditional, 1.0, 1.0, rope._freqs)
    return None


_calling: dict[type, type] = {}  # block class -> its subclass calling the kernel


def llama_shaped_blocks(model: Any) -> Iterator[Any]:
    """The model's decoder blocks of a ``LLAMA_SHAPED`` class (none for other families)."""
    for _, module in model.named_modules():
        cls = type(module)
        if (cls.__module__, cls.__qualname__) in LLAMA_SHAPED:
            yield module


def family_attention(block: Any) -> Callable[..., Any]:
    """The ``scaled_dot_product_attention`` the block's family module calls (wrapped for
    the kernels where they run)."""
    attend: Callable[..., Any] = sys.modules[type(block).__module__].scaled_dot_product_attention
    return attend


def original_call(block: Any) -> Callable[..., Any]:
    """The block class's own ``__call__`` (beneath the kernel's, where installed)."""
    cls = type(block)
    base = next((c for c, sub in _calling.items() if sub is cls), cls)
    call: Callable[..., Any] = base.__call__
    return call


def call_through(block: Any, call: Callable[..., Any]) -> None:
    """Give ``block`` a subclass of its class (one per class) whose ``__call__`` is
    ``call``; ``call`` reaches the original through ``original_call``."""
    cls = type(block)
    if cls in _calling.values():
        return
    sub = _calling.get(cls)
    if sub is None:
        sub = _calling[cls] = subclass_calling(cls, call)
    block.__class__ = sub
