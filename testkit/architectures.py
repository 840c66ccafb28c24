"""Tiny random-weight models of every text architecture mlx-lm ships, built in a second.

``tiny_config(model_type)`` writes a config that mlx-lm's own ``ModelArgs.from_dict``
accepts for that model type: hidden width 64, 4 layers, small MoE and SSM sizes, and the
layer patterns (sliding / full attention, linear attention, SSM blocks) the architecture
needs. Multimodal wrappers get their language model under ``text_config``, as published
checkpoints do. ``build_architecture_model`` saves one as a model directory that
``mlx_lm.load`` (and so the engine) loads, with a tokenizer copied from another directory.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import pkgutil
import shutil
from pathlib import Path
from typing import Any

# mlx_lm.models modules that are building blocks, not architectures.
_NOT_ARCHITECTURES = frozenset({
    "base", "cache", "activations", "rope_utils", "switch_layers", "pipeline", "gated_delta",
    "mla", "ssm", "bitlinear_layers",
})

# Architectures that cannot run here, with the reason (the sweep reports these, never hides
# them): each is a property of mlx-lm 0.32.2, not of the engine.
UNRUNNABLE = {
    "olmo": "mlx-lm's olmo module calls sys.exit unless the ai2-olmo package is installed "
            "(the engine raises UnsupportedModelError naming it)",
    "prism_hadamard_qwen35": "needs the Hadamard rotation pack its checkpoints ship "
                             "(mlx-lm refuses a config without one)",
}
# Architectures whose mlx-lm code runs a Metal kernel: they run on Apple GPUs only.
METAL_ONLY = {
    "bitnet": "mlx-lm's BitLinear layer is a Metal kernel ('No Metal back-end' elsewhere)",
    "muse_spark": "mlx-lm's fused qk-norm + RoPE is a Metal kernel ('No Metal back-end')",
}
# Not verified here: mlx-lm's own decode of the tiny model crashes the process on CPU.
CRASHES = {
    "phi3small": "segfaults inside mlx-lm's own generate_step on the CPU backend with the tiny "
                 "config (its block-sparse attention); not verified",
}

_LAYERS = 4
_SLIDING = ["sliding_attention", "full_attention"] * (_LAYERS // 2)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# Values by field name, used wherever an architecture's ModelArgs has that field: small
# enough for a 64-wide, 4-layer model, consistent with each other (heads * head_dim = 64).
COMMON: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": _LAYERS, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_eps": 1e-5,
    "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "attention_bias": False, "mlp_bias": False, "sliding_window": 32,
    "tie_word_embeddings": False, "partial_rotary_factor": 0.5,
    "n_embd": 64, "n_layer": _LAYERS, "n_head": 4, "n_inner": 128, "n_positions": 4096,
    "n_ctx": 4096, "d_model": 64, "n_layers": _LAYERS, "n_heads": 4, "num_layers": _LAYERS,
    "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 2, "model_dim": 64,
    "num_transformer_layers": _LAYERS, "n_kv_heads": 2, "block_size": 4096, "dim": 64,
    "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "num_attention_groups": 2,
    "max_seq_len": 4096, "kv_channels": 16, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "moe_num_experts": 4, "moe_top_k": 2,
    "hidden_size_per_head": 16,
}

# What COMMON cannot say: layer patterns, nested settings, a field an architecture reads
# under its own name. Keyed by model_type; wrappers' text configs are keyed by theirs.
OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": {"num_kv_reuse_layers": 1},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2},
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1.0,
                                     "mscale_all_dim": 0.0, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 4096}},
    # mlx-lm reads the pattern string; transformers' config (read when mlx-lm loads the
    # tokenizer) needs layer_types then, or it takes the string for a number.
    "exaone4": {"sliding_window_pattern": "LG", "layer_types": _SLIDING},
    "afmoe": {"layer_types": _SLIDING, "num_dense_layers": 1},
    "cohere2": {"sliding_window_pattern": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "exaone_moe": {"layer_types": _SLIDING, "is_moe_layer": [False, True, True, True]},
    "gear": {"layer_types": ["full_attention"] * _LAYERS},
    "gemma3_text": {"sliding_window_pattern": 2},
    "gemma3n": {"layer_types": _SLIDING, "num_kv_shared_layers": 2,
                "activation_sparsity_pattern": [0.0] * _LAYERS, "altup_num_inputs": 4,
                "altup_active_idx": 0, "altup_coef_clip": 120.0, "altup_correct_scale": True,
                "laurel_rank": 8, "hidden_size_per_layer_input": 16,
                "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0},
    "gemma4_text": {"layer_types": _SLIDING, "num_kv_shared_layers": 2, "global_head_dim": 32,
                    "hidden_size_per_layer_input": 16,
                    "num_global_key_value_heads": 1},
    "glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "rope_parameters": dict(_ROPE), "index_head_dim": 16, "index_n_heads": 2,
                    "index_topk": 8},
    "gptj": {"rotary_dim": 8},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * (_LAYERS // 2),
                         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False,
                         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "mamba_expand": 2,
                         "shared_intermediate_size": 64},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "type": "dynamic", "factor": 1.0}, "moe_topk": 2,
                "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_cla": False,
                "cla_share_factor": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "mamba_d_conv": 4, "mamba_d_state": 8,
              "mamba_expand": 2},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                           "head_dim": 16, "num_heads": 4,
                                           "short_conv_kernel_size": 4},
                    "model_max_length": 4096},
    "kimi_k3": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                       "head_dim": 16, "num_heads": 4,
                                       "short_conv_kernel_size": 4},
                "num_experts_per_token": 2},
    "lfm2": {"layer_types": ["conv", "full_attention"] * (_LAYERS // 2), "conv_L_cache": 3,
             "block_dim": 64, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (_LAYERS // 2),
                 "conv_L_cache": 3, "num_dense_layers": 1},
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0], "intermediate_size_mlp": 128,
                    "num_experts_per_tok": 1},
    "llama4": {"no_rope_layers": [1, 1, 1, 0], "intermediate_size_mlp": 128,
               "num_experts_per_tok": 1, "attention_chunk_size": 16,
               "interleave_moe_layer_step": 2},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                      "attention_method": "MLA", "zero_expert_type": "identity",
                      "zero_expert_num": 1, "moe_topk": 2},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                            "zero_expert_num": 1, "moe_topk": 2, "ngram_vocab_size_ratio": 2},
    "mamba2": {"time_step_limit": [0.0, float("inf")], "time_step_rank": "auto",
               "num_heads": 8, "head_dim": 16,
               "state_size": 16, "n_groups": 1, "conv_kernel": 4},
    "mellum": {"layer_types": _SLIDING,
               "rope_parameters": {"full_attention": dict(_ROPE),
                                   "sliding_attention": dict(_ROPE)}},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096}},
    "mimo_v2_flash": {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "moe_layer_freq": [0, 1, 1, 1], "hybrid_layer_pattern": [1, 0, 1, 0],
                      "sliding_window_size": 32, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "swa_head_dim": 16, "swa_v_head_dim": 16,
                      "swa_rope_theta": 10000.0, "layernorm_epsilon": 1e-5},
    "ministral3": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 4096}},
    "mistral4": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 4096}},
    "muse_spark": {"rope_parameters": dict(_ROPE), "layer_rope_theta": [10000.0] * _LAYERS,
                   "layer_types": _SLIDING, "final_logit_softcapping": 30.0,
                   "output_multiplier": 1.0, "post_norm_eps": 1e-5, "moe_hidden_size": 32,
                   "num_shared_experts": 0, "mlp_layer_types": ["sparse"] * _LAYERS,
                   "audio_config": {"out_hidden_size": 64}},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2},
                                        "ffn": {"ffn_mult": 1.0}}] * _LAYERS},
    "nemotron_h": {"hybrid_override_pattern": list("M*M-"), "mamba_num_heads": 8,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4},
    "olmo3": {"layer_types": _SLIDING},
    "openelm": {"num_query_heads": [4] * _LAYERS, "num_kv_heads": [2] * _LAYERS,
                "ffn_multipliers": [1.0] * _LAYERS, "ffn_dim_divisor": 8},
    "phixtral": {"rotary_dim": 8},
    "plamo": {"n_shared_head": 2},
    "plamo2": {"mamba_d_state": 16, "mamba_num_heads": 8, "attention_window_size": 32,
               "mamba_chunk_size": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "recurrent", "attention"],
                        "conv1d_width": 4, "logits_soft_cap": 30.0,
                        "attention_window_size": 32},
    "spark2_5": {"layer_types": _SLIDING,
                 "rope_parameters": {"full_attention": dict(_ROPE),
                                     "sliding_attention": dict(_ROPE)}},
}

# Per-architecture weight scales where the default one would not do.
WEIGHT_SCALES: dict[str, float] = {}

# Wrappers whose language model sits under text_config: the text config's model_type and
# the ModelArgs class (module, name) it is read with. Wrappers with a class of their own
# (TextModelArgs, TextArgs, TextConfig) are found without an entry here.
TEXT_MODELS: dict[str, tuple[str, str]] = {
    "gemma3": ("gemma3_text", "gemma3_text"),
    "gemma4": ("gemma4_text", "gemma4_text"),
    "qwen2_vl": ("qwen2", "qwen2"),
    "qwen3_vl": ("qwen3", "qwen3"),
    "qwen3_vl_moe": ("qwen3_moe", "qwen3_moe"),
    "pixtral": ("llama", "llama"),
    "mistral3": ("ministral3", "ministral3"),
    "lfm2-vl": ("lfm2", "lfm2"),
    "kimi_k25": ("deepseek_v3", "deepseek_v3"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "qwen3_5"),
    "prism_hadamard_qwen35": ("qwen3_5_text", "qwen3_5"),
}


# model_types mlx-lm loads with another architecture's module (its MODEL_REMAPPING).
MODEL_REMAPS = {"mistral": "llama"}


def architectures() -> list[str]:
    """Every model_type mlx-lm ships a module for, sorted."""
    import mlx_lm.models

    return sorted(info.name for info in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if info.name not in _NOT_ARCHITECTURES)


def _required_guess(field: dataclasses.Field[Any]) -> Any:
    """A value for a required field COMMON does not know, from its annotation."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__",
                                                                        str(field.type))
    annotation = annotation.replace("typing.", "")
    for prefix, value in (("int", 2), ("float", 1.0), ("bool", False), ("str", "")):
        if annotation.startswith(prefix):
            return value
    return None


def _filled(args_class: type, model_type: str, vocab_size: int) -> dict[str, Any]:
    """A config for one ModelArgs class: COMMON where it has the field, guesses for the
    remaining required fields, then the architecture's OVERRIDES."""
    config: dict[str, Any] = {"model_type": model_type}
    for field in dataclasses.fields(args_class):
        if field.name in COMMON:
            config[field.name] = copy.deepcopy(COMMON[field.name])
        elif field.name in ("vocab_size", "vocab_size_per_layer_input"):
            config[field.name] = vocab_size
        elif (field.default is dataclasses.MISSING
              and field.default_factory is dataclasses.MISSING and field.name not in config):
            config[field.name] = _required_guess(field)
    config["vocab_size"] = vocab_size
    if "vocab_size_per_layer_input" in config:
        config["vocab_size_per_layer_input"] = vocab_size
    config.update(copy.deepcopy(OVERRIDES.get(model_type, {})))
    if model_type == "phixtral":
        config["num_vocab"] = vocab_size
    return config


def _text_args_class(module: Any, model_type: str) -> tuple[str, type] | None:
    """The text model's (model_type, ModelArgs class) of a wrapper, or None."""
    if model_type in TEXT_MODELS:
        text_type, text_module = TEXT_MODELS[model_type]
        text_mod = importlib.import_module(f"mlx_lm.models.{text_module}")
        return text_type, getattr(text_mod, "TextModelArgs", text_mod.ModelArgs)
    for name in ("TextModelArgs", "TextArgs", "TextConfig"):
        if hasattr(module, name):
            return model_type, getattr(module, name)
    return None


def tiny_config(model_type: str, vocab_size: int = 512) -> dict[str, Any]:
    """A tiny config for ``model_type`` that mlx-lm's ``ModelArgs.from_dict`` accepts."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = _filled(module.ModelArgs, model_type, vocab_size)
    fields = {field.name for field in dataclasses.fields(module.ModelArgs)}
    if "text_config" in fields:
        found = _text_args_class(module, model_type)
        if found is not None:
            text_type, text_class = found
            text = _filled(text_class, text_type, vocab_size)
            text.update(copy.deepcopy(OVERRIDES.get(TEXT_MODELS.get(model_type, ("",))[0], {})))
            config["text_config"] = text
    return config


def save_random_model(config: dict[str, Any], out: Path, *, seed: int = 0,
                      weight_scale: float = 2.0, max_params: int = 5_000_000) -> Path:
    """Write random float32 weights and ``config`` as an mlx-lm model directory (``out``,
    created). Weights are scaled up so that greedy continuations vary (default init makes
    a model this small repeat one token)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import save_config, save_model

    model_type = str(config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config)))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    if n_params > max_params:  # a field the config missed left a published default size
        raise ValueError(f"{model_type}: the tiny config still makes {n_params} parameters")
    model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p,
                          model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    logits = model(mx.array([[1, 2, 3, 4]]))
    if not bool(mx.all(mx.isfinite(logits)).item()):  # a config value the model cannot use
        raise ValueError(f"{model_type}: the tiny config makes non-finite logits")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config({**config, "torch_dtype": "float32"}, out / "config.json")
    return out


def build_architecture_model(model_type: str, out: Path, tokenizer_dir: Path, *,
                             vocab_size: int, seed: int = 0,
                             weight_scale: float = 2.0) -> Path:
    """Write a random-weight ``model_type`` model with ``tokenizer_dir``'s tokenizer to
    ``out`` (created) and return it."""
    save_random_model(tiny_config(model_type, vocab_size), out, seed=seed,
                      weight_scale=WEIGHT_SCALES.get(model_type, weight_scale))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    eos = json.loads((tokenizer_dir / "config.json").read_text()).get("eos_token_id")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
