"""A llama-shaped decoder layer's decode step as two kernel ops around the cache's update.

At one query a row a layer is ~25 graph nodes; each costs the Python forward, MLX's
evaluation and an allocation, which at one row is about a third of the step. Here the
layer is ``cpu_kernels.decode_qkv`` (RMSNorm, the q/k/v products, RoPE), the cache's own
``update_and_fetch``, and ``cpu_kernels.decode_rest`` (attention, o, residual, RMSNorm,
gate/up, SiLU, down, residual): the separate kernels' code in their order, so the logits
carry the same bits as the layer-by-op forward.

A block takes it (``install``) where ``upstream.decoder_blocks`` names its class (llama,
Qwen2, Qwen3) and its parts are the kernels' own: sibling q/k/v and gate/up groups, plain
RMSNorms, a RoPE of a form the kernel takes, float32 biases on q/k/v only. Each call
checks that they still are (a row adapter, a float16 KV projection or a quantized cache
swaps a part or the cache kind), and that the forward is a one-query forward of a marked
model; anything else runs the block's own forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.device.kernels import cpu_kernels
from engine.device.kernels.kernel_layers import (
    KernelQuantizedLinear,
    KernelSiblingLinear,
    kernel_mask,
)
from engine.device.upstream.decoder_blocks import (
    RopeForm,
    call_through,
    family_attention,
    llama_shaped_blocks,
    original_call,
    rope_form,
)
from engine.device.upstream.fast_ops import in_marked_forward

ENV_SWITCH = "MLX_PROVIDERS_DECODE_LAYER"
# False: every block runs its own forward, op by op (``MLX_PROVIDERS_DECODE_LAYER=0``; tests
# and benches compare the two).
SWITCH = os.environ.get(ENV_SWITCH, "1") != "0"


@dataclass(frozen=True)
class LayerParts:
    """The modules of one block that the two ops read, found at install."""

    attention: nn.Module
    qkv: tuple[nn.Module, nn.Module, nn.Module]
    o_proj: nn.Module
    norms: tuple[nn.Module, nn.Module]
    gate_up: tuple[nn.Module, nn.Module]
    down: nn.Module
    rope: RopeForm
    mlp: nn.Module
    qk_norms: tuple[nn.Module, nn.Module] | None  # Qwen3's per-head norms

    # (parent, key, part): what each parent must still hold (an nn.Module is a dict, so
    # item lookups, not attribute ones: this runs for every layer of every decode step).
    held: tuple[tuple[Any, str, nn.Module], ...] = ()

    def intact(self) -> bool:
        """Whether the block still holds these parts, each of the class it had, and its
        sibling groups still compute in one call."""
        for parent, key, part in self.held:
            if parent.get(key) is not part:
                return False
        for member in (*self.qkv, *self.gate_up):
            if type(member) is not KernelSiblingLinear:
                return False
        return (type(self.o_proj) is KernelQuantizedLinear
                and type(self.down) is KernelQuantizedLinear
                and self.qkv[0]._mlx_providers_siblings.fusing
                and self.gate_up[0]._mlx_providers_siblings.fusing)


def _projection(module: nn.Module) -> cpu_kernels.Projection:
    return module["weight"], module["scales"], module["biases"]


def _siblings_of(members: tuple[nn.Module, ...]) -> bool:
    """Whether ``members`` are one sibling group of kernel projections, in its order."""
    if not all(type(m) is KernelSiblingLinear for m in members):
        return False
    group = members[0]._mlx_providers_siblings
    return list(group.members) == list(members)


def _parts(block: Any) -> LayerParts | None:
    """The block's parts where the two ops compute its forward exactly; else None."""
    attention, mlp = block.self_attn, block.mlp
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up = (mlp.gate_proj, mlp.up_proj)
    norms = (block.input_layernorm, block.post_attention_layernorm)
    projections = (*qkv, attention.o_proj, *gate_up, mlp.down_proj)
    if not (_siblings_of(qkv) and _siblings_of(gate_up)
            and type(attention.o_proj) is KernelQuantizedLinear
            and type(mlp.down_proj) is KernelQuantizedLinear):
        return None
    biased = ["bias" in m for m in projections]
    if (biased[3:] != [False] * 4 or len(set(biased[:3])) != 1
            or any("bias" in m and m["bias"].dtype != mx.float32 for m in qkv)
            or len({m._mlx_providers_int8 for m in projections}) != 1
            or any(m["scales"].dtype != mx.float32 for m in projections)):
        return None  # float32 outputs, one activation path for the whole layer
    qk_norms = ((attention.q_norm, attention.k_norm) if "q_norm" in attention else None)
    plain = (*norms, *(qk_norms or ()))
    if any(type(n) is not nn.RMSNorm or n["weight"].dtype != mx.float32 for n in plain):
        return None
    if qk_norms is not None and qk_norms[0].eps != qk_norms[1].eps:
        return None
    rope = rope_form(attention.rope)
    if rope is None or (rope.freqs is not None and rope.freqs.dtype != mx.float32):
        return None
    heads, kv_heads = attention.n_heads, attention.n_kv_heads
    dim = qkv[0]["weight"].shape[0] // heads
    if (dim * heads != qkv[0]["weight"].shape[0] or dim > cpu_kernels.ATTENTION_MAX_DIM
            or heads % kv_heads != 0
            or any(m["weight"].shape[0] != kv_heads * dim for m in qkv[1:])):
        return None
    held = ((block, "self_attn", attention), (block, "mlp", mlp),
            (block, "input_layernorm", norms[0]), (block, "post_attention_layernorm", norms[1]),
            *((attention, key, part) for key, part in zip(("q_proj", "k_proj", "v_proj"), qkv)),
            (attention, "o_proj", attention.o_proj), (attention, "rope", attention.rope),
            (mlp, "gate_proj", gate_up[0]), (mlp, "up_proj", gate_up[1]),
            (mlp, "down_proj", mlp.down_proj),
            *((attention, key, part) for key, part in zip(("q_norm", "k_norm"), qk_norms or ())))
    return LayerParts(attention, qkv, attention.o_proj, norms, gate_up, mlp.down_proj, rope,
                      mlp, qk_norms, held)


def _offset(cache: Any) -> mx.array:
    offset = cache.offset
    if isinstance(offset, mx.array):
        return offset if offset.dtype == mx.int32 else offset.astype(mx.int32)
    return mx.array(offset, dtype=mx.int32)


def _forward(block: Any, parts: LayerParts, x: mx.array, mask: Any, cache: Any) -> mx.array:
    attention, rope, qk_norms = parts.attention, parts.rope, parts.qk_norms
    lead = parts.qkv[0]
    q, k, v = cpu_kernels.decode_qkv(
        x, parts.norms[0]["weight"], parts.norms[0].eps, [_projection(m) for m in parts.qkv],
        lead.group_size, lead.bits, lead._mlx_providers_int8, attention.n_heads,
        attention.n_kv_heads, rope.dims, rope.traditional, rope.base, rope.scale,
        _offset(cache), rope.freqs,
        [m["bias"] for m in parts.qkv] if "bias" in lead else None,
        [n["weight"] for n in qk_norms] if qk_norms is not None else None,
        qk_norms[0].eps if qk_norms is not None else 0.0)
    keys, values = cache.update_and_fetch(k, v)
    usable, array, causal = kernel_mask(mask, 1)
    if not (usable and isinstance(keys, mx.array) and isinstance(values, mx.array)
            and keys.dtype == values.dtype == mx.float32):
        # A cache that hands back another kind: the block's own remaining steps.
        out = family_attention(block)(q, keys, values, cache=cache, scale=attention.scale,
                                      mask=mask)
        h = x + parts.o_proj(out.transpose(0, 2, 1, 3).reshape(x.shape[0], 1, -1))
        after: mx.array = h + parts.mlp(parts.norms[1](h))
        return after
    gate, down = parts.gate_up[0], parts.down
    return cpu_kernels.decode_rest(
        q, keys, values, attention.scale, array, causal, x, _projection(parts.o_proj),
        (parts.o_proj.group_size, parts.o_proj.bits), parts.norms[1]["weight"],
        parts.norms[1].eps, _projection(gate), _projection(parts.gate_up[1]),
        (gate.group_size, gate.bits), _projection(down), (down.group_size, down.bits),
        lead._mlx_providers_int8)


def _call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    parts: LayerParts | None = getattr(self, "_mlx_providers_decode", None)
    if (SWITCH and parts is not None and cache is not None and in_marked_forward()
            and x.ndim == 3 and x.shape[1] == 1 and x.dtype == mx.float32
            and not hasattr(cache, "bits") and parts.intact()):
        return _forward(self, parts, x, mask, cache)
    own: mx.array = original_call(self)(self, x, mask, cache)
    return own


def install(model: nn.Module) -> int:
    """Give each llama-shaped block whose parts the ops take the two-op decode step; the
    number of blocks given it."""
    count = 0
    for block in llama_shaped_blocks(model):
        parts = _parts(block)
        if parts is None:
            continue
        object.__setattr__(block, "_mlx_providers_decode", parts)  # a plain attribute
        call_through(block, _call)
        count += 1
    return count
