"""The CPU kernels inside a loaded mlx-lm model: its quantized layers and its attention.

``install`` changes the class of each plain ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
whose layout the matmul kernel takes to a subclass that calls it (no weight is copied or
changed: saving, sharding helpers and ``weights_bytes`` see the same parameters), and routes
the attention of the model's family through the fused kernel while this model runs: the
family module's ``scaled_dot_product_attention`` is wrapped once per process (by the upstream
seam, ``upstream.fast_ops``), and the wrapper takes the kernel only inside a forward of a
model ``install`` marked, so other models of the family in the process keep MLX's attention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.device.kernels import cpu_kernels
from engine.device.upstream.fast_ops import in_marked_forward as _in_kernel_forward
from engine.device.upstream.fast_ops import wrap_family, wrap_fast


class KernelQuantizedLinear(nn.QuantizedLinear):  # type: ignore[misc]
    """``nn.QuantizedLinear`` whose product runs the CPU kernel."""

    _mlx_providers_int8 = False  # install(int8=True) sets it on the instance

    def __call__(self, x: mx.array) -> mx.array:
        y = cpu_kernels.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                         self.group_size, self.bits, self._mlx_providers_int8)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):  # type: ignore[misc]
    """``nn.QuantizedEmbedding`` whose tied output projection runs the CPU kernel."""

    _mlx_providers_int8 = False

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                            self.group_size, self.bits, self._mlx_providers_int8)


class KernelSiblingLinear(KernelQuantizedLinear):
    """A quantized projection that shares its input with siblings (q/k/v, gate/up): the first
    of them called with an input computes all their products in one kernel call."""

    def __call__(self, x: mx.array) -> mx.array:
        siblings: Siblings = self._mlx_providers_siblings
        return siblings.output(self, x)


class Siblings:
    """Projections of one parent that mlx-lm calls one after another on the same input.

    The first member called with an input ``x`` runs one ``quantized_matmul_many`` for all
    of them and keeps the others' outputs for their calls with that same ``x`` (the same
    array object: mlx-lm passes one ``x`` to each). A member called with another input
    computes afresh, so a parent that feeds its siblings different inputs stays correct; one
    that keeps doing so (outputs computed and never asked for) makes the group fall back to
    one product per member."""

    GIVE_UP_AFTER = 3  # computed-but-unused outputs before the group stops fusing

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.fusing = True
        self._wasted = 0
        self._pending = threading.local()  # .x and .outputs (None where handed out)

    def output(self, member: nn.Module, x: mx.array) -> mx.array:
        index: int = member._mlx_providers_index
        pending = self._pending
        outputs: list[mx.array | None] | None = getattr(pending, "outputs", None)
        if outputs is not None and pending.x is x and outputs[index] is not None:
            out = outputs[index]
            assert out is not None
            outputs[index] = None
            if all(o is None for o in outputs):
                pending.outputs = pending.x = None
            return out
        if outputs is not None and any(o is not None for o in outputs):
            self._wasted += 1
            if self._wasted >= self.GIVE_UP_AFTER:
                self.fusing = False
        pending.outputs = pending.x = None
        if not self.fusing:
            return KernelQuantizedLinear.__call__(member, x)
        lead = self.members[0]
        products = cpu_kernels.quantized_matmul_many(
            x, [m["weight"] for m in self.members], [m["scales"] for m in self.members],
            [m["biases"] for m in self.members], lead.group_size, lead.bits,
            lead._mlx_providers_int8)
        results: list[mx.array | None] = [
            y + m["bias"] if "bias" in m else y for m, y in zip(self.members, products)]
        mine = results[index]
        assert mine is not None
        results[index] = None
        pending.x, pending.outputs = x, results
        return mine


# Children of one parent that mlx-lm's families call on the same input, in this order.
SIBLING_NAMES: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"),
                                              ("gate_proj", "up_proj"))


def _group_siblings(model: nn.Module) -> int:
    """Join each parent's kernel projections of ``SIBLING_NAMES`` (same bits and group size);
    the number of groups made."""
    groups = 0
    for _, parent in model.named_modules():
        for names in SIBLING_NAMES:
            found = [parent.get(name) if isinstance(parent, dict) else None for name in names]
            members: list[nn.Module] = [m for m in found if type(m) is KernelQuantizedLinear]
            if len(members) != len(names):
                continue
            lead = members[0]
            if any(m.bits != lead.bits or m.group_size != lead.group_size
                   or m["scales"].dtype != lead["scales"].dtype
                   or m["weight"].shape[1] != lead["weight"].shape[1] for m in members):
                continue
            siblings = Siblings(members)
            for index, member in enumerate(members):
                member.__class__ = KernelSiblingLinear
                # Plain attributes (not arrays or modules): no parameter or child is added.
                object.__setattr__(member, "_mlx_providers_siblings", siblings)
                object.__setattr__(member, "_mlx_providers_index", index)
            groups += 1
    return groups


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
    sibling_groups: int = 0
    int8: str = ""  # the int8-activation path the products take, "" for float32
    norm_and_rope: bool = False  # mx.fast.rms_norm and mx.fast.rope on the kernels
    decode_layers: int = 0  # blocks whose one-query step is two ops (decode_layer)

    def describe(self) -> str:
        """For ``stats().cpu_kernels``, after the instruction set."""
        parts = []
        if self.quantized_layers:
            parts.append(f"matmul {self.kernel_layers}/{self.quantized_layers} quantized layers")
        if self.int8:
            parts.append(f"int8 activations ({self.int8})")
        if self.sibling_groups:
            parts.append(f"{self.sibling_groups} sibling groups in one call each")
        if self.attention:
            parts.append("decode attention")
        if self.norm_and_rope:
            parts.append("RMSNorm and RoPE")
        if self.decode_layers:
            parts.append(f"{self.decode_layers} layers' decode step in two ops")
        return ", ".join(parts) if parts else "nothing to run"


def _modules(model: nn.Module) -> Iterator[nn.Module]:
    for _, module in model.named_modules():
        yield module


def _takes_kernel(module: nn.Module) -> bool:
    biases = module.get("biases") if hasattr(module, "get") else None
    return (biases is not None and module["weight"].ndim == 2
            and cpu_kernels.qmm_supported(module.bits, module.group_size,
                                          getattr(module, "mode", "affine")))


def install(model: nn.Module, int8: bool = False) -> Installed:
    """Put the model's quantized layers and attention on the CPU kernels (see module doc);
    ``int8``: their products take int8 activations where the CPU has that path
    (``cpu_kernels.int8_path()``; else the float kernels, silently: ``Installed`` says)."""
    path = cpu_kernels.int8_path() if int8 else ""
    quantized = swapped = 0
    for module in _modules(model):
        replacement = _SWAPS.get(type(module))
        if replacement is None:
            continue
        quantized += 1
        if _takes_kernel(module):
            module.__class__ = replacement
            if path:
                object.__setattr__(module, "_mlx_providers_int8", True)
            swapped += 1
    attention = wrap_family(model, _WRAPPERS)  # the seam wraps; its wrappers call the kernels
    wrap_fast(model, _FAST_WRAPPERS)
    return Installed(swapped, quantized, attention, _group_siblings(model),
                     path if swapped else "", True)


# ---- attention -----------------------------------------------------------------------------


def kernel_mask(mask: Any, queries: int) -> tuple[bool, mx.array | None, bool]:
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

    return swiglu


def _quantized_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                         scale: float, mask: Any) -> mx.array | None:
    """The quantized-KV kernel's output for a cache with ``bits`` (keys and values arrive
    as ``mx.quantize``'s triples), or None where it does not take the call (mlx-lm's
    quantized path then runs). Any number of queries: mlx-lm's alternative is two
    ``mx.quantized_matmul`` calls, slower on the CPU than the kernel in prefill too."""
    bits, group_size = getattr(cache, "bits", None), getattr(cache, "group_size", None)
    if (not isinstance(bits, int) or not isinstance(group_size, int)
            or not isinstance(keys, (tuple, list)) or not isinstance(values, (tuple, list))
            or len(keys) != 3 or len(values) != 3):
        return None
    qk: cpu_kernels.Triple = (keys[0], keys[1], keys[2])
    qv: cpu_kernels.Triple = (values[0], values[1], values[2])
    if not cpu_kernels.quantized_attention_supported(queries, qk, qv, group_size, bits):
        return None
    usable, array, causal = kernel_mask(mask, queries.shape[2])
    if not usable:
        return None
    return cpu_kernels.quantized_attention(queries, qk, qv, scale, group_size, bits, array,
                                           causal)


def _half_kv(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """float32 queries over a float16 cache (``EngineConfig.kv_dtype``)."""
    return (queries.dtype == mx.float32 and keys.dtype == values.dtype == mx.float16)


def _wrap(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                     scale: float, mask: Any, sinks: Any = None) -> mx.array:
        if _in_kernel_forward() and sinks is None and hasattr(cache, "bits"):
            out = _quantized_attention(queries, keys, values, cache, scale, mask)
            if out is not None:
                return out
        elif (_in_kernel_forward() and sinks is None
                and isinstance(keys, mx.array) and queries.ndim == 4
                and queries.shape[2] <= cpu_kernels.ATTENTION_MAX_QUERIES
                and (queries.dtype == keys.dtype == values.dtype or _half_kv(queries, keys,
                                                                             values))
                and max(queries.shape[-1], values.shape[-1]) <= 256):
            usable, array, causal = kernel_mask(mask, queries.shape[2])
            if usable and queries.dtype != keys.dtype:
                # kv_dtype="float16": the kernel reads the float16 cache in place (it
                # computes in float32); the few query values are cast, not the cache.
                out = cpu_kernels.attention(queries.astype(keys.dtype), keys, values, scale,
                                            array, causal)
                return out.astype(queries.dtype)
            if usable:
                return cpu_kernels.attention(queries, keys, values, scale, array, causal)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


_WRAPPERS: dict[str, Callable[[Callable[..., mx.array]], Callable[..., mx.array]]] = {
    "scaled_dot_product_attention": _wrap,
    "swiglu": _wrap_swiglu,
}


def _wrap_rms_norm(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *,
                 stream: Any = None) -> mx.array:
        if (_in_kernel_forward() and stream is None and x.dtype == mx.float32 and x.ndim >= 1
                and (weight is None or (weight.dtype == mx.float32 and weight.ndim == 1))):
            return cpu_kernels.rms_norm(x, weight, eps)
        return original(x, weight, eps, stream=stream)

    return rms_norm


def _wrap_rope(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def rope(a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float,
             offset: int | mx.array, freqs: mx.array | None = None,
             stream: Any = None) -> mx.array:
        if (_in_kernel_forward() and stream is None and a.dtype == mx.float32 and a.ndim >= 3
                and (freqs is None or (freqs.dtype == mx.float32 and base is None))
                and (freqs is not None or base is not None)
                and (not isinstance(offset, mx.array) or offset.ndim <= 1)):
            return cpu_kernels.rope(a, dims, traditional, base, scale, offset, freqs)
        return original(a, dims, traditional=traditional, base=base, scale=scale,
                        offset=offset, freqs=freqs, stream=stream)

    return rope


# mx.fast's functions, wrapped once per process: every family reaches RMSNorm and RoPE
# through them (nn.RMSNorm, nn.RoPE, mlx-lm's own norm and scaled-RoPE classes).
_FAST_WRAPPERS: dict[str, Callable[[Callable[..., mx.array]], Callable[..., mx.array]]] = {
    "rms_norm": _wrap_rms_norm,
    "rope": _wrap_rope,
}
