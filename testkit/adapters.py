"""Tiny LoRA adapters in mlx-lm's format, made by hand in a second, and mlx-lm's own greedy
tokens with an adapter (as ``load(..., adapter_path=...)`` applies it, or fused): the
reference a row with that adapter must equal. ``fused_checkpoint`` fuses one into a copy of
a checkpoint, for references (mlx-vlm's) that cannot load adapters."""

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

    from engine.device.adapters.row_adapters import linear_dims

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
    return write_adapter(out, weights, rank=rank, scale=scale, keys=keys,
                         num_layers=len(chosen))


def write_adapter(out: Path, weights: dict[str, Any], *, rank: int, scale: float = 10.0,
                  keys: Sequence[str] = (), num_layers: int = 0) -> Path:
    """Write ``weights`` (``<module path>.lora_a`` and ``.lora_b``) as an adapter directory
    whose config says ``rank`` (what mlx-lm builds its layers at)."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                            "keys": list(keys)}}, indent=2))
    return out


def fused_checkpoint(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """A copy of the (unquantized) checkpoint at ``model_dir`` with the adapter fused into
    its weights as mlx-lm's ``LoRALinear.fuse`` does (``W + (scale * B.T) @ A.T``): the
    reference for a library that cannot load the adapter itself (mlx-vlm)."""
    import shutil

    import mlx.core as mx

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = float(config["lora_parameters"]["scale"])
    lora = mx.load(str(adapter_dir / "adapters.safetensors"))
    assert isinstance(lora, dict)
    pending = {k[: -len(".lora_a")] for k in lora if k.endswith(".lora_a")}
    out.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
            continue
        weights = mx.load(str(item))
        assert isinstance(weights, dict)
        for path in sorted(pending & {k[: -len(".weight")] for k in weights}):
            assert f"{path}.scales" not in weights, "a quantized layer: fuse it yourself"
            weight = weights[f"{path}.weight"]
            delta = (scale * lora[f"{path}.lora_b"].T) @ lora[f"{path}.lora_a"].T
            weights[f"{path}.weight"] = weight + delta.astype(weight.dtype)
            pending.discard(path)
        mx.save_safetensors(str(out / item.name), weights)
    assert not pending, f"no weights in the checkpoint for {sorted(pending)[:3]}"
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
