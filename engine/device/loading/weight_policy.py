"""How a loaded model's weights run on this backend: the CPU weight policy.

On Metal and CUDA quantized weights are fast and stay as loaded. On the CPU:

- with the CPU kernels (``engine.device.kernels.cpu_kernels``): quantized layers stay quantized and
  run the kernels, attention runs the fused kernel, unless ``quantized=False`` asks for
  float32;
- without them: MLX's quantized CPU ops are 3-200x slower than float32 through BLAS, so a
  quantized model (an mlx-community ``-4bit`` directory, say) is dequantized to float32 when
  that fits in memory (``quantized=None``), or on request (``quantized=False``);
  ``quantized=True`` keeps it quantized on MLX's ops.

GGUF files are converted by ``engine.models`` with the same rule, so they arrive here in the
chosen form. ``WeightChoice`` is what ``stats()`` reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.device.kernels import cpu_kernels, decode_layer
from engine.device.kernels.kernel_layers import install
from engine.device.loading.memory import on_accelerator, usable_memory_bytes

# Dequantize only while float32 weights take at most this share of memory: the rest is for
# the KV cache, the runtime and whatever else the machine runs.
DEQUANTIZE_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class WeightChoice:
    """The weights' form and the CPU kernels' part, as ``stats()`` reports them."""

    weight_format: str  # "quantized", "float32", "dequantized" (float32 from quantized), ...
    cpu_kernels: str  # "" off the CPU; else the kernels in use, or "off: why"

    def stats(self) -> dict[str, str]:
        """The ``EngineStats`` fields this choice sets."""
        return {"weight_format": self.weight_format, "cpu_kernels": self.cpu_kernels}


_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def _quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, _QUANTIZED)]


def _describe_quantized(modules: list[nn.Module]) -> str:
    widths = sorted({f"{m.bits}-bit g{m.group_size}" for m in modules})
    return "quantized " + "/".join(widths)


def _float32_bytes(model: nn.Module, modules: list[nn.Module]) -> int:
    """Bytes of the model with its quantized layers in float32."""
    total = 0
    for name, array in _flat(model.parameters()):
        if not name.endswith((".scales", ".biases")) and array.dtype != mx.uint32:
            total += array.size * 4
    for m in modules:
        total += m["weight"].shape[0] * m["weight"].shape[1] * 32 // m.bits * 4
    return total


def _flat(tree: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    leaves = tree_flatten(tree)
    assert isinstance(leaves, list)
    return [(f"{prefix}{k}", v) for k, v in leaves]


def _dequantized(module: nn.Module) -> nn.Module:
    """A float32 ``nn.Linear`` / ``nn.Embedding`` with the quantized layer's values."""
    weight = mx.dequantize(module["weight"], module["scales"].astype(mx.float32),
                           module["biases"].astype(mx.float32), group_size=module.group_size,
                           bits=module.bits).astype(mx.float32)
    if isinstance(module, nn.QuantizedEmbedding):
        plain: nn.Module = nn.Embedding(weight.shape[0], weight.shape[1])
    else:
        plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
        if "bias" in module:
            plain.bias = module["bias"].astype(mx.float32)
    plain.weight = weight
    mx.eval(plain.parameters())
    return plain


def dequantize_model(model: nn.Module) -> int:
    """Replace every affine quantized layer by its float32 twin; how many were replaced."""
    replaced = 0
    for _, parent in model.named_modules():
        for key, child in list(parent.children().items()):
            if isinstance(child, list):
                for i, item in enumerate(child):
                    if _dequantizable(item):
                        child[i] = _dequantized(item)
                        replaced += 1
            elif _dequantizable(child):
                parent[key] = _dequantized(child)
                replaced += 1
    return replaced


def _dequantizable(module: Any) -> bool:
    return (type(module) in _QUANTIZED and getattr(module, "mode", "affine") == "affine"
            and module.get("biases") is not None)


def _float_format(model: nn.Module) -> str:
    """The floating dtype of the model's weights ("float32", "bfloat16"...)."""
    for _, array in _flat(model.parameters()):
        if mx.issubdtype(array.dtype, mx.floating):
            return str(array.dtype).removeprefix("mlx.core.")
    return "float"


def apply_weight_policy(model: nn.Module, quantized: bool | None,
                        int8: bool = False) -> WeightChoice:
    """Put ``model`` (just loaded, on this thread's device) in the form the policy picks;
    ``int8``: the kernels' products take int8 activations where the CPU can."""
    modules = _quantized_modules(model)
    if on_accelerator():
        return WeightChoice(_describe_quantized(modules) if modules else _float_format(model), "")
    status = cpu_kernels.kernel_status()
    keep = quantized is True or (quantized is None and status.available)
    if modules and not keep and quantized is None:  # no kernels: float32 if it fits
        keep = _float32_bytes(model, modules) > DEQUANTIZE_MEMORY_SHARE * usable_memory_bytes()
    if modules and not keep:
        dequantize_model(model)
        form = "dequantized float32"
    else:
        form = _describe_quantized(modules) if modules else _float_format(model)
    if not status.available:
        return WeightChoice(form, status.describe())
    installed = install(model, int8)
    installed = dataclasses.replace(installed, decode_layers=decode_layer.install(model))
    return WeightChoice(form, f"{status.describe()}: {installed.describe()}")
