"""The CPU kernels inside a loaded mlx-lm model: its quantized layers and its attention.

``install`` changes the class of each plain ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
whose layout the matmul kernel takes to a subclass that calls it (no weight is copied or
changed: saving, sharding helpers and ``weights_bytes`` see the same parameters), and routes
the attention of the model's family through the fused kernel while this model runs: the
family module's ``scaled_dot_product_attention`` is wrapped once per process, and the wrapper
takes the kernel only inside a forward of a model ``install`` marked (a thread-local flag its
``__call__`` sets), so other models of the family in the process keep MLX's attention.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.device import cpu_kernels

_forward = threading.local()  # .active: inside a forward of a model with the kernels


def _in_kernel_forward() -> bool:
    return bool(getattr(_forward, "active", False))


class KernelQuantizedLinear(nn.QuantizedLinear):  # type: ignore[misc]
    """``nn.QuantizedLinear`` whose product runs the CPU kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = cpu_kernels.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                         self.group_size, self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):  # type: ignore[misc]
    """``nn.QuantizedEmbedding`` whose tied output projection runs the CPU kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                            self.group_size, self.bits)


_SWAPS: dict[type, type] = {
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
}


@dataclass(frozen=True)
class Installed:
    """What ``install`` put on the kernels: quantized layers (of all there are), attention."""

    kernel_layers: int
    quantized_layers: int
    attention: bool

    def describe(self) -> str:
        """For ``stats().cpu_kernels``, after the instruction set."""
        parts = []
        if self.quantized_layers:
            parts.append(f"matmul {self.kernel_layers}/{self.quantized_layers} quantized layers")
        if self.attention:
            parts.append("decode attention")
        return ", ".join(parts) if parts else "nothing to run"


def _modules(model: nn.Module) -> Iterator[nn.Module]:
    for _, module in model.named_modules():
        yield module


def _takes_kernel(module: nn.Module) -> bool:
    biases = module.get("biases") if hasattr(module, "get") else None
    return (biases is not None and module["weight"].ndim == 2
            and cpu_kernels.qmm_supported(module.bits, module.group_size,
                                          getattr(module, "mode", "affine")))


def install(model: nn.Module) -> Installed:
    """Put the model's quantized layers and attention on the CPU kernels (see module doc)."""
    quantized = swapped = 0
    for module in _modules(model):
        replacement = _SWAPS.get(type(module))
        if replacement is None:
            continue
        quantized += 1
        if _takes_kernel(module):
            module.__class__ = replacement
            swapped += 1
    attention = _route_attention(model)
    return Installed(swapped, quantized, attention)


# ---- attention -----------------------------------------------------------------------------


def _kernel_mask(mask: Any, queries: int) -> tuple[bool, mx.array | None, bool]:
    """(usable, mask array for the kernel, causal) for mlx-lm's mask argument."""
    if mask is None:
        return True, None, False
    if isinstance(mask, str):
        return mask == "causal", None, mask == "causal"
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False, None, False
    if mask.dtype == mx.bool_:
        return True, mask, False
    return True, mask.astype(mx.float32), False


def _wrap_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if (_in_kernel_forward() and gate.shape == x.shape and gate.dtype == x.dtype
                and gate.dtype in (mx.float32, mx.float16, mx.bfloat16)):
            return cpu_kernels.silu_mul(gate, x)
        return original(gate, x)

    swiglu.__wrapped__ = original  # type: ignore[attr-defined]
    swiglu._mlx_providers_kernel = True  # type: ignore[attr-defined]
    return swiglu


def _wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                     scale: float, mask: Any, sinks: Any = None) -> mx.array:
        if (_in_kernel_forward() and sinks is None and not hasattr(cache, "bits")
                and isinstance(keys, mx.array) and queries.ndim == 4
                and queries.shape[2] <= cpu_kernels.ATTENTION_MAX_QUERIES
                and queries.dtype == keys.dtype == values.dtype
                and max(queries.shape[-1], values.shape[-1]) <= 256):
            usable, array, causal = _kernel_mask(mask, queries.shape[2])
            if usable:
                return cpu_kernels.attention(queries, keys, values, scale, array, causal)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    scaled_dot_product_attention._mlx_providers_kernel = True  # type: ignore[attr-defined]
    return scaled_dot_product_attention


_route_lock = threading.Lock()
_marked: dict[type, type] = {}


def _marked_class(cls: type) -> type:
    """A subclass of a model class whose forward lets the attention wrapper take the kernel."""
    found = _marked.get(cls)
    if found is not None:
        return found

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = _in_kernel_forward()
        _forward.active = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _forward.active = outer

    marked = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})
    _marked[cls] = marked
    return marked


_WRAPPERS: dict[str, Callable[[Callable[..., mx.array]], Callable[..., mx.array]]] = {
    "scaled_dot_product_attention": _wrap,
    "swiglu": _wrap_swiglu,
}


def _route_attention(model: nn.Module) -> bool:
    """Wrap the model family's attention (and swiglu) functions once; mark this model's
    forwards. False when the family computes attention its own way (MLX's then)."""
    family = sys.modules.get(type(model).__module__)
    if family is None or getattr(family, "scaled_dot_product_attention", None) is None:
        return False
    with _route_lock:
        for name, wrap in _WRAPPERS.items():
            current = getattr(family, name, None)
            if current is not None and not getattr(current, "_mlx_providers_kernel", False):
                setattr(family, name, wrap(current))
        if type(model) not in _marked.values():
            model.__class__ = _marked_class(type(model))
    return True
