"""Tiny random-weight models of the cache kinds mlx-lm ships, for the engine's speed-up matrix.

One architecture per kind of KV state a row can hold, each with the tiny qwen2 test model's
tokenizer and chat template (so chat requests, tools and the prefix store's heads work as on
the default test model):

- ``gemma3_text``, ``gpt_oss``: sliding-window attention (``RotatingKVCache``, a 32-token
  window here, so a test prompt wraps it) beside full attention layers;
- ``qwen3_next`` (gated delta linear attention), ``lfm2`` (short convolutions) and
  ``granitemoehybrid`` (Mamba 2 blocks): state (``ArraysCache``) beside full attention;
- ``mamba2``: state only.

``build_cache_kind_model(model_type, out, tokenizer_dir, vocab_size=...)`` has the shape of
the shared builder for every architecture (``build_architecture_model`` on the families
branch) so the two fold into one: these configs are that builder's entries for these types.
"""

from __future__ import annotations

import copy
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

WINDOW = 32  # sliding-window size: small enough that a test prompt wraps the ring

_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 4096, "rope_theta": 10000.0}

# model_type -> the fields its ModelArgs needs besides model_type and vocab_size.
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3_text": {**_ATTENTION, "hidden_size": 64, "num_hidden_layers": 4,
                    "intermediate_size": 128, "rms_norm_eps": 1e-6,
                    "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
                    "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0},
    "gpt_oss": {**_ATTENTION, "hidden_size": 64, "num_hidden_layers": 4,
                "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                "rms_norm_eps": 1e-5, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "qwen3_next": {**_ATTENTION, "hidden_size": 64, "num_hidden_layers": 4,
                   "intermediate_size": 128, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 32, "mlp_only_layers": [],
                   "moe_intermediate_size": 32, "rms_norm_eps": 1e-6,
                   "partial_rotary_factor": 0.5, "full_attention_interval": 2},
    "lfm2": {**_ATTENTION, "hidden_size": 64, "num_hidden_layers": 4, "norm_eps": 1e-5,
             "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
             "layer_types": ["conv", "full_attention"] * 2},
    "granitemoehybrid": {**_ATTENTION, "hidden_size": 64, "num_hidden_layers": 4,
                         "intermediate_size": 128, "attention_bias": False,
                         "embedding_multiplier": 1.0, "attention_multiplier": 0.25,
                         "logits_scaling": 1.0, "residual_multiplier": 1.0,
                         "layer_types": ["mamba", "attention"] * 2, "rms_norm_eps": 1e-5,
                         "shared_intermediate_size": 64, "mamba_n_heads": 8,
                         "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "mamba_expand": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
               "state_size": 16, "num_hidden_layers": 4, "layer_norm_epsilon": 1e-5,
               "conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": True, "time_step_limit": [0.0, float("inf")],
               "time_step_rank": "auto", "max_position_embeddings": 4096},
}

# What each model's cache holds, for reports and test ids.
KINDS: dict[str, str] = {
    "gemma3_text": "sliding window", "gpt_oss": "sliding window",
    "qwen3_next": "hybrid (linear attention)", "lfm2": "hybrid (convolution)",
    "granitemoehybrid": "hybrid (mamba)", "mamba2": "state-space",
}


def cache_kind_config(model_type: str, vocab_size: int,
                      scale: dict[str, int] | None = None) -> dict[str, Any]:
    """The config for ``model_type``; ``scale`` overrides sizes (a benchmark's ~100M model)."""
    config = {"model_type": model_type, "vocab_size": vocab_size,
              **copy.deepcopy(CONFIGS[model_type])}
    config.update(scale or {})
    return config


def build_cache_kind_model(model_type: str, out: Path, tokenizer_dir: Path, *,
                           vocab_size: int, seed: int = 0, weight_scale: float = 2.0,
                           scale: dict[str, int] | None = None) -> Path:
    """Write a random-weight ``model_type`` model with ``tokenizer_dir``'s tokenizer and
    chat template to ``out`` (created) and return it.

    Weights are float32 and scaled up so greedy continuations vary (default init makes a
    model this small repeat one token), which makes identical-output checks meaningful.
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import save_config, save_model

    config = cache_kind_config(model_type, vocab_size, scale)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config)))
    model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p,
                          model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    logits = model(mx.array([[1, 2, 3, 4]]))
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise ValueError(f"{model_type}: the config makes non-finite logits")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config({**config, "torch_dtype": "float32"}, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    eos = json.loads((tokenizer_dir / "config.json").read_text()).get("eos_token_id")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


# ~100M-parameter shapes for benchmarks (random weights time like trained ones): the
# default model's width (576) and vocabulary, and each family's layer pattern.
_WIDE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "max_position_embeddings": 8192}
BENCH_SIZES: dict[str, dict[str, Any]] = {
    # Gemma 3: five sliding-window layers (512 tokens) per global one.
    "gemma3_text": {**_WIDE, "num_hidden_layers": 24, "intermediate_size": 1536,
                    "sliding_window": 512, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 64},
    # LFM2: short convolutions, a third of the layers full attention.
    "lfm2": {**_WIDE, "num_hidden_layers": 18, "block_ff_dim": 1536, "block_dim": 576,
             "layer_types": ["conv", "conv", "full_attention"] * 6},
    # Mamba 2 blocks with attention every fourth layer (Granite 4 hybrids).
    "granitemoehybrid": {**_WIDE, "num_hidden_layers": 16, "intermediate_size": 1536,
                         "shared_intermediate_size": 1536, "attention_multiplier": 0.125,
                         "layer_types": ["mamba", "mamba", "mamba", "attention"] * 4,
                         "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_d_state": 64},
    "mamba2": {"hidden_size": 576, "intermediate_size": 1152, "num_heads": 18,
               "head_dim": 64, "state_size": 64, "num_hidden_layers": 24},
}


def bench_model(model_type: str, tokenizer_dir: Path, root: Path) -> Path:
    """A ~100M-parameter random ``model_type`` with ``tokenizer_dir``'s tokenizer, built
    once under ``root`` (reused by later runs)."""
    import os

    out = root / f"{model_type}-100m-v1"
    if not (out / "config.json").exists():
        vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
        partial = out.with_name(out.name + f".tmp{os.getpid()}")
        build_cache_kind_model(model_type, partial, tokenizer_dir, vocab_size=vocab,
                               weight_scale=1.0, scale=BENCH_SIZES[model_type])
        os.replace(partial, out)
    return out
