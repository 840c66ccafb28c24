"""Tensor and backend work that model acquisition needs: GGUF tensors in, safetensors out.

``engine.models`` decides what to convert and where; the arrays themselves are handled
here so that ``engine.device`` stays the only importer of mlx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def accelerator_available() -> bool:
    """Whether mlx runs on Metal or CUDA here (quantized weights are fast there)."""
    import mlx.core as mx  # deferred: a BLAS library may need loading before mlx

    if mx.metal.is_available():
        return True
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def cpu_kernels_available() -> bool:
    """Whether this package's CPU kernels load and pass their check here."""
    from engine.device.kernels.cpu_kernels import kernels_available

    return kernels_available()


def _unpermute_rows(x: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation (HF's rotate-half layout -> interleaved pairs).

    It only reorders rows (output features), so it applies unchanged to packed quantized
    weights and to their per-row scales and biases.
    """
    rows = x.shape[0]
    split = x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:])
    return split.swapaxes(1, 2).reshape(x.shape)


def load_gguf_weights(
    path: Path,
    renamed: dict[str, str],
    *,
    n_head: int,
    n_kv: int,
    quantized: bool,
    float_dtype: str,
    group_size: int,
) -> tuple[dict[str, Any], dict[str, int]]:
    """HF-named weights and, for modules kept quantized, their bit width.

    ``renamed`` maps each GGUF tensor base name to its HF module name.
    """
    import mlx.core as mx

    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)  # a .gguf always loads as a name -> array mapping
    weights: dict[str, mx.array] = {}
    for name, array in loaded.items():
        base, _, part = name.rpartition(".")  # part: weight / scales / biases
        if base.endswith(".attn_q"):
            array = _unpermute_rows(array, n_head)
        elif base.endswith(".attn_k"):
            array = _unpermute_rows(array, n_kv)
        weights[f"{renamed[base]}.{part}"] = array

    bits: dict[str, int] = {}
    for key in [k for k in weights if k.endswith(".scales")]:
        module = key.removesuffix(".scales")
        packed = weights[f"{module}.weight"]
        module_bits = packed.shape[-1] // weights[key].shape[-1]  # uint32 words per group of 32
        if quantized:
            bits[module] = module_bits
            continue
        # Dequantize from float32 scales so the result is exact, not rounded to float16.
        weights[f"{module}.weight"] = mx.dequantize(
            packed,
            weights.pop(key).astype(mx.float32),
            weights.pop(f"{module}.biases").astype(mx.float32),
            group_size=group_size,
            bits=module_bits,
        )
    target = getattr(mx, float_dtype)
    floats = (mx.float32, mx.float16, mx.bfloat16)
    return {k: v.astype(target) if v.dtype in floats else v for k, v in weights.items()}, bits


def save_weights(path: Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def download_from_hub(repo_id: str) -> Path:
    """A hub snapshot directory, fetched with mlx-lm's own helper and file patterns."""
    from mlx_lm.utils import _download

    return Path(_download(repo_id))
