"""A model whose forward is as cheap as this machine allows, with a real vocabulary.

The default model's tokenizer and chat template (SmolLM2, 49,152 tokens) on a llama of
2 layers, hidden 128, random weights, end-of-sequence never the greedy choice: a step
costs about MLX's CPU dispatch floor, so what the engine adds on the host shows, as it
would beside a GPU's 1.5-5 ms step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")
_VERSION = "v2"  # v2: the end-of-sequence rows zeroed


def bench_cache() -> Path:
    """Where benches keep what they build: ``MLX_PROVIDERS_BENCH_CACHE`` or the user cache."""
    return Path(os.environ.get("MLX_PROVIDERS_BENCH_CACHE",
                               Path.home() / ".cache" / "mlx-providers" / "bench"))


def host_regime_model(root: Path | None = None, *, layers: int = 2, hidden: int = 128,
                      heads: int = 4, seed: int = 0) -> Path:
    """The model directory under ``root`` (default: ``bench_cache()``), built once, then
    reused.

    ``layers``/``hidden``/``heads`` size it: the defaults are the host regime; 24 x 1280
    with 20 heads is a ~0.5B llama, a GPU's small model (``bench/device_check.sh``).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from engine.models.default_model import default_model_gguf
    from engine.models.user_cache import converted_gguf_dir

    root = bench_cache() if root is None else root
    shape = f"{layers}x{hidden}" + (f"h{heads}" if heads != 4 else "")
    target = root / f"host-regime-{shape}-s{seed}-{_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    source = converted_gguf_dir(default_model_gguf(), quantized=True)
    config = json.loads((source / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config.update(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  head_dim=hidden // heads)
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, building / name)
    (building / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model, _ = load_model(building, lazy=True, strict=False)
    weights = dict(tree_flatten(model.parameters()))
    # A zero output row gives end-of-sequence a logit of 0, below the greedy maximum of 49k
    # random logits: no row ends by itself, so every door decodes the whole window.
    ends = config.get("eos_token_id", [])
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in weights:
            table = weights[name]
            for end in ends if isinstance(ends, list) else [ends]:
                table[end] = mx.zeros_like(table[end])
            weights[name] = table
            break
    mx.save_safetensors(str(building / "model.safetensors"), weights)
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)
    return target


def _main() -> None:
    import argparse

    import engine  # noqa: F401 - its fast BLAS loads before mlx does

    parser = argparse.ArgumentParser(description="Build (once) and print a host-regime model.")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    print(host_regime_model(layers=args.layers, hidden=args.hidden, heads=args.heads))


if __name__ == "__main__":
    _main()
