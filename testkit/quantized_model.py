"""A tiny quantized model: the tiny random qwen2 (testkit.tiny_model) with 64-wide heads,
quantized by mlx-lm to MLX's affine 4-bit layout in groups of 32, float32 elsewhere: the
layout of a ``-4bit`` model directory, small enough to build in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

from testkit.tiny_model import build_tiny_model


def build_quantized_tiny_model(out: Path, *, bits: int = 4, group_size: int = 32) -> Path:
    """Write the quantized model directory to ``out`` (must not exist) and return it."""
    from mlx_lm.convert import convert

    dense = out.with_name(out.name + ".dense")
    build_tiny_model(dense, hidden=128, heads=2, kv_heads=1)  # head size 64, GQA 2:1
    try:
        convert(str(dense), str(out), quantize=True, q_group_size=group_size, q_bits=bits,
                dtype="float32")
    finally:
        shutil.rmtree(dense, ignore_errors=True)
    return out
