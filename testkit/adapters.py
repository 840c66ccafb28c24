"""Tiny LoRA adapters in mlx-lm's format, made by hand in a second, and mlx-lm's own greedy
tokens with an adapter (as ``load(..., adapter_path=...)`` applies it, or fused): the
reference a row with that adapter must equal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def make_adapter(out: Path, model_dir: Path, *, seed: int, rank: int = 8,
                 scale: float = 10.0, keys: Sequence[str] = ("self_attn.q_proj",
                                                            "self_attn.v_proj"),
                 layers: int | None = None) -> Path:
    """Write an adapter for the model at ``model_dir``: random ``lora_a`` and ``lora_b``
    (mlx-lm starts ``lora_b`` at zero; a trained one is not) on ``keys`` of the last
    ``layers`` blocks (all by default)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.device.row_adapters import linear_dims

    model = load_model(Path(model_dir))[0]
    blocks = model.layers
    chosen = range(len(blocks) - (layers or len(blocks)), len(blocks))
    prefix = next(name.rsplit("layers.", 1)[0] for name, _ in model.named_modules()
                  if name.endswith("layers.0"))
    modules = dict(model.named_modules())
    mx.random.seed(seed)
    weights: dict[str, Any] = {}
    for i in chosen:
        for key in keys:
            path = f"{prefix}layers.{i}.{key}"
            out_dims, in_dims = linear_dims(modules[path])
            weights[f"{path}.lora_a"] = mx.random.normal((in_dims, rank)) * in_dims ** -0.5
            weights[f"{path}.lora_b"] = mx.random.normal((rank, out_dims)) * rank ** -0.5
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": len(chosen),
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                            "keys": list(keys)}}, indent=2))
    return out


def mlx_lm_tokens(model_dir: Path, adapter_dir: Path | None, prompt: Sequence[int],
                  max_tokens: int, *, fused: bool = False) -> list[int]:
    """Greedy tokens of mlx-lm's own single-request generation with the adapter applied
    (its LoRA layers, or fused into the weights)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model = load_model(Path(model_dir))[0]
    if adapter_dir is not None:
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, str(adapter_dir))
        if fused:
            from mlx.utils import tree_unflatten

            fused_layers = [(n, m.fuse()) for n, m in model.named_modules()
                            if hasattr(m, "fuse")]
            model.update_modules(tree_unflatten(fused_layers))
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens):
        tokens.append(int(token))
    return tokens
