"""Tiny random-weight vision-language checkpoints of many families, built offline.

One builder a family, each writing a model directory in its family's Hugging Face layout
(``config.json`` with ``model_type``, ``text_config``, ``vision_config``; a tokenizer with
the family's image tokens; a ``preprocessor_config.json`` with the family's processor
settings) that ``mlx_vlm.utils.load_model`` loads. Sizes are toy (text hidden 64, two
layers, two heads; a tower of hidden 32 on images of 32 to 64 px), weights random and
seeded, as in ``testkit.vision_model``, whose helpers they share. Nothing is downloaded.
``ZOO_BUILDERS`` maps each checkpoint's ``model_type`` to its builder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from testkit.vision_model import save_model, save_weights, scale_language, tiny_vlm_tokenizer


class ZooBuildError(Exception):
    """A family's checkpoint cannot be built tiny (the reason is the message)."""


def _start(out: Path, tokens: Sequence[str],
           tokenizer_config: dict[str, Any] | None = None) -> tuple[int, int, dict[str, int]]:
    """The tokenizer with ``tokens`` added, saved to ``out``: its end-of-turn id, its
    vocabulary rounded up to 64, and the added tokens' ids."""
    tokenizer = tiny_vlm_tokenizer(out, tokens, tokenizer_config or {})
    eos = tokenizer.token_to_id("<|im_end|>")
    vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    return eos, vocab, {t: tokenizer.token_to_id(t) for t in tokens}


def _preprocessor(out: Path, settings: dict[str, Any]) -> None:
    (out / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))


def _random_model(config: dict[str, Any], seed: int) -> Any:
    """The mlx-vlm model for ``config``, its config objects built as ``load_model`` builds
    them (the family module its ``model_type`` names; text, vision, audio and projector
    sub-configs), its weights drawn from ``seed``."""
    import copy

    import mlx.core as mx
    from mlx_vlm import utils

    config = copy.deepcopy(config)
    update_module_configs: Any = utils.update_module_configs
    module, _ = utils.get_model_and_args(config)
    config.setdefault("text_config", config.pop("llm_config", {}))
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    built = update_module_configs(module.ModelConfig.from_dict(config), module, config,
                                  ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    return module.Model(built)


HALF = [0.5, 0.5, 0.5]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

# The audio block's marks last, so the image and video tokens keep their ids.
GEMMA4_TOKENS = ("<|image>", "<|image|>", "<image|>", "<|audio|>", "<|video|>",
                 "<|audio>", "<audio|>")


def build_tiny_gemma4(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Gemma 4 (``gemma4``): its patch tower (2D RoPE, a learned position table,
    patches averaged ``pooling_kernel_size`` square), a ``gemma4_text`` model with
    per-layer inputs, an image's tokens attending to each other both ways
    (``use_bidirectional_attention: "vision"``). Real: 16 px patches pooled 3x3, up to 280
    tokens an image at its aspect ratio; tiny: 8 px patches pooled 2x2, up to 9 tokens
    (40x40 px -> 48x48 px, 9 tokens; 100x30 px -> 80x16 px, 5 tokens). Its processor's
    settings are in ``processor_config.json``'s ``image_processor``, as the real
    checkpoints keep them (where mlx-vlm's processor reads them). Its audio tower is the
    small models' conformer (``audio_config``: a two-layer subsampling convolution over
    128 log-mel bins, chunked local attention) at toy size: hidden 32, two layers; a clip
    takes one ``<|audio|>`` a 40 ms between ``<|audio>`` and ``<audio|>``, as real."""
    eos, vocab, ids = _start(out, GEMMA4_TOKENS, {
        "boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
        "audio_token": "<|audio|>", "video_token": "<|video|>", "boa_token": "<|audio>",
        "eoa_token": "<audio|>"})
    config = {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "vocab_size": vocab, "hidden_size": 64, "pad_token_id": 0, "eos_token_id": [eos],
        "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"], "audio_token_id": ids["<|audio|>"],
        "video_token_id": ids["<|video|>"], "vision_soft_tokens_per_image": 9,
        "boa_token_id": ids["<|audio>"], "eoa_token_id": ids["<audio|>"],
        "audio_soft_tokens_per_image": 750, "audio_ms_per_token": 40,
        "tie_word_embeddings": True, "torch_dtype": "float32",
        # Real (E2B/E4B): hidden 1024, 12 layers, 8 heads, channels (128, 32), 1536 out.
        "audio_config": {
            "model_type": "gemma4_audio", "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "hidden_act": "silu",
            "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5,
            "residual_weight": 0.5, "attention_chunk_size": 12,
            "attention_context_left": 13, "attention_context_right": 0,
            "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9,
            "use_clipped_linears": True, "rms_norm_eps": 1e-6,
            "gradient_clipping": 1e10, "output_proj_dims": 48},
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "global_head_dim": 32, "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 0, "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "use_bidirectional_attention": "vision",
            "max_position_embeddings": 4096, "use_double_wide_mlp": False,
            "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                   "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        },
        "vision_config": {
            "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 16, "global_head_dim": 16, "patch_size": 8,
            "position_embedding_size": 64, "pooling_kernel_size": 2,
            "default_output_length": 9, "rms_norm_eps": 1e-6,
        },
    }
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": 9,
        "audio_seq_length": 750, "audio_ms_per_token": 40,
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor", "patch_size": 8,
            "pooling_kernel_size": 2, "max_soft_tokens": 9, "do_resize": True, "resample": 3,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
            "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
            "do_convert_rgb": True}}, indent=2))
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    embed = model.language_model.model.embed_tokens  # Gemma scales it up by sqrt(hidden)
    embed.weight = embed.weight * (0.2 / weight_scale)
    return save_model(out, model, config, eos, tied=True)


GEMMA3N_TOKENS = ("<start_of_image>", "<start_of_audio>")


def build_tiny_gemma3n(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Gemma 3n (``gemma3n``): a ``gemma3n_text`` model (AltUp, LAuReL, per-layer
    inputs) at toy size, a toy audio tower, and the real vision tower, which mlx-vlm builds
    whatever the config says: MobileNetV5 (294M parameters, hidden 2048, 256 tokens an
    image from a 16x16 fusion grid, images of at least 256 px; real 768 px). It is saved
    in bfloat16 (about 590 MB; the build takes seconds, the tower's forward on a CPU about
    40 s at 256 px). Vocabulary as in the real one: text ids, then 128 vision ids from
    ``<end_of_image>`` and ``<image_soft_token>``, then 128 audio ids."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from tokenizers import AddedToken

    tokenizer = tiny_vlm_tokenizer(out, GEMMA3N_TOKENS, {
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>", "boa_token": "<start_of_audio>",
        "audio_token": "<audio_soft_token>", "eoa_token": "<end_of_audio>"})
    eos = tokenizer.token_to_id("<|im_end|>")
    text_vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    # Filler ids up to the text vocabulary's end, then the vision and audio ranges.
    names = [f"<unused{k}>" for k in range(text_vocab - tokenizer.get_vocab_size(True))]
    names += ["<end_of_image>", "<image_soft_token>", *(f"<vision{k}>" for k in range(126)),
              "<end_of_audio>", "<audio_soft_token>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in names])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in (*GEMMA3N_TOKENS, *names[-130:])}
    assert ids["<end_of_image>"] == text_vocab and ids["<end_of_audio>"] == text_vocab + 128
    vocab = text_vocab + 256
    config = {
        "model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
        "vocab_size": vocab, "hidden_size": 2048, "pad_token_id": 0, "eos_token_id": [eos],
        "image_token_id": ids["<image_soft_token>"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_id": ids["<start_of_image>"], "eoi_token_id": ids["<end_of_image>"],
        "audio_token_id": ids["<audio_soft_token>"], "boa_token_id": ids["<start_of_audio>"],
        "eoa_token_id": ids["<end_of_audio>"], "vision_soft_tokens_per_image": 256,
        "audio_soft_tokens_per_image": 8, "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3n_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": [128, 128], "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": vocab,
            "vocab_size_per_layer_input": text_vocab, "hidden_size_per_layer_input": 8,
            "laurel_rank": 8, "altup_num_inputs": 4, "altup_active_idx": 0,
            "altup_correct_scale": True, "altup_coef_clip": 120.0,
            "num_kv_shared_layers": 0,
            "activation_sparsity_pattern": [0.95, 0.0], "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 4096, "final_logit_softcapping": 30.0,
            "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
        },
        "vision_config": {
            "model_type": "gemma3n_vision", "architecture": "mobilenetv5_300m_enc",
            "hidden_size": 2048, "vocab_size": 128, "vocab_offset": text_vocab,
            "rms_norm_eps": 1e-6, "image_size": 256, "num_channels": 3,
        },
        "audio_config": {
            "model_type": "gemma3n_audio", "input_feat_size": 128, "hidden_size": 32,
            "conf_num_attention_heads": 2, "conf_num_hidden_layers": 1,
            "sscp_conv_channel_size": [8, 4], "vocab_size": 128,
            "vocab_offset": text_vocab + 128, "rms_norm_eps": 1e-6,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "SiglipImageProcessorFast", "processor_class": "Gemma3nProcessor",
        "size": {"height": 256, "width": 256}, "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
        "image_seq_length": 256, "feature_size": 128, "sampling_rate": 16000})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    tower = model.vision_tower
    tower.update(tree_map(lambda p: p.astype(mx.bfloat16), tower.parameters()))
    save_model(out, model, config, eos)
    # The published layout (everything under ``model.``, the text model's layers right
    # under ``model.language_model.``), which mlx-lm's gemma3n reads and mlx-vlm's maps back.
    weights = mx.load(str(out / "model.safetensors"))
    save_weights(out, {"model." + name.replace("language_model.model.", "language_model.", 1):
                       value for name, value in weights.items()})
    return out


def _grid_tokens(rows: int) -> tuple[str, ...]:
    return tuple(f"<row_{r}_col_{c}>" for r in range(1, rows + 1) for c in range(1, rows + 1))


IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>",
                   "<end_of_utterance>", *_grid_tokens(4))


def build_tiny_idefics3(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Idefics3 (``idefics3``): a SigLIP tower on square views, pixel shuffle by
    ``scale_factor``, a Llama text model. Real: 364 px views (14 px patches, shuffle 2:
    169 tokens a view), images split into a grid of views up to 1456 px plus a global
    view; tiny: 32 px views (8 px patches, shuffle 2: 4 tokens), up to a 4x4 grid."""
    return _tiny_idefics3(out, "idefics3", seed=seed, weight_scale=weight_scale,
                          view=32, scale_factor=2)


def build_tiny_smolvlm(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny SmolVLM (``smolvlm``): Idefics3's model and image layout with a pixel
    shuffle of 4. Real: 512 px views (16 px patches: 64 tokens a view), split up to
    2048 px plus a global view; tiny: 64 px views (8 px patches: 4 tokens), up to 4x4."""
    return _tiny_idefics3(out, "smolvlm", seed=seed, weight_scale=weight_scale,
                          view=64, scale_factor=4)


def _tiny_idefics3(out: Path, family: str, *, seed: int, weight_scale: float, view: int,
                   scale_factor: int) -> Path:
    eos, vocab, ids = _start(out, IDEFICS3_TOKENS, {
        "image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    patch = 8
    tokens = (view // patch) ** 2 // scale_factor ** 2
    name = "Idefics3" if family == "idefics3" else "SmolVLM"
    config = {
        "model_type": family, "architectures": [f"{name}ForConditionalGeneration"],
        "image_token_id": ids["<image>"], "scale_factor": scale_factor, "vocab_size": vocab,
        "eos_token_id": [eos], "pad_token_id": 0, "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 1e5,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": f"{family}_vision", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "patch_size": patch,
            "image_size": view, "num_channels": 3, "layer_norm_eps": 1e-6,
        },
    }
    _preprocessor(out, {
        "image_processor_type": f"{name}ImageProcessor", "processor_class": f"{name}Processor",
        "do_resize": True, "size": {"longest_edge": 4 * view},
        "max_image_size": {"longest_edge": view}, "do_image_splitting": True,
        "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": HALF, "image_std": HALF, "do_pad": True, "do_convert_rgb": True})
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": f"{name}Processor", "image_seq_len": tokens}))
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


LLAMA4_TOKENS = ("<|image_start|>", "<|image|>", "<|patch|>", "<|image_end|>",
                 "<|tile_x_separator|>", "<|tile_y_separator|>")


def build_tiny_llama4(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Llama 4 (``llama4``): its tower (2D RoPE, pixel shuffle 0.5, an adapter
    MLP) and a ``llama4_text`` model of four layers, dense and mixture-of-experts in turn
    (two experts and a shared one), chunked attention, every fourth layer global without
    RoPE. Real: 336 px tiles
    (14 px patches: 144 tokens a tile), up to 4 tiles (mlx-vlm's processor's grids) plus a
    global view; tiny: 56 px tiles (14 px patches, which mlx-vlm's processor assumes
    whatever the config says: 4 tokens a tile)."""
    eos, vocab, ids = _start(out, LLAMA4_TOKENS)
    config = {
        "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
        "image_token_index": ids["<|patch|>"], "boi_token_index": ids["<|image_start|>"],
        "eoi_token_index": ids["<|image_end|>"], "eos_token_id": [eos],
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "text_config": {
            # Four layers: mlx-lm's Llama 4 takes every fourth layer's cache as the
            # global (no-RoPE) one, so it fails on fewer.
            "model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 64, "intermediate_size_mlp": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 500000.0,
            "num_local_experts": 2, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2, "moe_layers": [1, 3],
            "no_rope_layers": [1, 1, 1, 0],
            "attention_chunk_size": 8192, "attention_bias": False, "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 8192, "attn_scale": 0.1, "max_position_embeddings": 4096,
            "bos_token_id": 0, "pad_token_id": 0, "eos_token_id": [eos],
            "rope_scaling": None, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "llama4_vision_model", "hidden_size": 32, "image_size": 56,
            "initializer_range": 0.02, "intermediate_size": 128, "norm_eps": 1e-5,
            "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 2,
            "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0,
            "projector_input_dim": 64, "projector_output_dim": 64, "rope_theta": 10000,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "vision_output_dim": 64,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
        "size": {"height": 56, "width": 56}, "max_patches": 16,
        "resize_to_max_canvas": False, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": HALF,
        "image_std": HALF, "do_convert_rgb": True})
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Llama4Processor", "patch_size": 14, "pixel_shuffle_ratio": 0.5}))
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


MISTRAL3_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def build_tiny_ministral3(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Mistral 3 of the later checkpoints (``mistral3`` with a ``ministral3`` text
    model: YaRN RoPE and Llama 4's position-dependent attention scaling, a tied head):
    Pixtral's tower, 2x2 patch merging. Real: up to 1540 px on the longest edge, 14 px
    patches, 28 px a token; tiny: up to 64 px, 8 px patches, 16 px a token. A row of
    ``[IMG]`` tokens ends in ``[IMG_BREAK]``, the last row in ``[IMG_END]``."""
    eos, vocab, ids = _start(out, MISTRAL3_TOKENS)
    config = {
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": ids["[IMG]"], "spatial_merge_size": 2,
        "vision_feature_layer": -1, "vocab_size": vocab, "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu", "eos_token_id": eos, "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "ministral3", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "rms_norm_eps": 1e-5, "vocab_size": vocab,
            "max_position_embeddings": 262144, "tie_word_embeddings": True,
            "sliding_window": None, "rope_parameters": {
                "type": "yarn", "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1},
        },
        "vision_config": {
            "model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16,
            "image_size": 64, "patch_size": 8, "rope_theta": 10000.0,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "PixtralImageProcessorFast", "processor_class": "PixtralProcessor",
        "size": {"longest_edge": 64}, "patch_size": 8, "do_resize": True, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True})
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]"}))
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos, tied=True)


INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>",
                   "</ref>", "<box>", "</box>")


def build_tiny_internvl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny InternVL (``internvl_chat``, InternVL 3's layout: the text config under
    ``llm_config``, a Qwen2 text model): InternViT (a class token, dropped after the
    tower), pixel shuffle 0.5, an MLP projector. Real: 448 px tiles (14 px patches: 256
    tokens a tile), up to 12 tiles plus a thumbnail; tiny: 32 px tiles (8 px patches:
    4 tokens). An image is ``<img>``, ``<IMG_CONTEXT>`` a token, ``</img>``."""
    eos, vocab, ids = _start(out, INTERNVL_TOKENS)
    config = {
        "model_type": "internvl_chat", "architectures": ["InternVLChatModel"],
        "template": "internvl2_5", "image_token_index": ids["<IMG_CONTEXT>"],
        "downsample_ratio": 0.5, "select_layer": -1, "force_image_size": 32,
        "dynamic_image_size": True, "max_dynamic_patch": 12, "min_dynamic_patch": 1,
        "use_thumbnail": True, "ps_version": "v2", "vocab_size": vocab,
        "eos_token_id": eos, "torch_dtype": "float32",
        "llm_config": {
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256,
            "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "rope_theta": 1e6, "max_position_embeddings": 4096,
            "attention_bias": True, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "intern_vit_6b", "architectures": ["InternVisionModel"],
            "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 64, "patch_size": 8, "image_size": 32, "num_channels": 3,
            "layer_norm_eps": 1e-6, "qkv_bias": True, "qk_normalization": False,
            "norm_type": "layer_norm", "drop_path_rate": 0.0,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "CLIPImageProcessor", "size": 32, "crop_size": 32,
        "do_resize": True, "do_center_crop": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": IMAGENET_MEAN,
        "image_std": IMAGENET_STD, "do_convert_rgb": True})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


def build_tiny_phi4_siglip(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Phi-4 vision model (``phi4-siglip``, Phi-4-reasoning-vision's layout: the
    text fields at the top level as in LLaVA, a Phi-3-shaped text model with a fused
    ``qkv_proj``): a SigLIP2 NaFlex tower on packed patches at the image's aspect ratio,
    its second-to-last layer through a two-layer MLP, a token a patch (no merging). The
    prompt holds ``<image>``, which the processor turns into the single id -200 that the
    model replaces by all the image's features (the sequence grows). Real: 16 px patches,
    256 to 3600 an image; tiny: 8 px patches, 4 to 16 (32x32 px -> 16 tokens). Chosen
    over ``phi4mm`` (Phi-4-multimodal), whose model carries a conformer audio encoder and
    vision and speech LoRA adapters on its text model."""
    eos, vocab, _ = _start(out, ())
    text = {
        "model_type": "phi4-siglip", "vocab_size": vocab, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "hidden_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "partial_rotary_factor": 1.0, "rope_scaling": None,
    }
    config = {
        **text, "architectures": ["Phi4ForCausalLMV"], "text_config": dict(text),
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "mm_hidden_size": 32, "mm_projector_type": "mlp2x_gelu",
        "mm_vision_tower": "google/siglip2-so400m-patch16-naflex",
        "mm_vision_select_layer": -2, "min_num_patches": 4, "max_num_patches": 16,
        "eos_token_id": eos, "pad_token_id": 0, "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "siglip2_vision_model", "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_channels": 3, "patch_size": 8, "num_patches": 16, "image_size": 32,
            "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
        },
    }
    _preprocessor(out, {
        "image_processor_type": "Siglip2ImageProcessor", "patch_size": 8,
        "max_num_patches": 16, "min_num_patches": 4, "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": HALF, "image_std": HALF, "do_convert_rgb": True})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


KIMI_VL_TOKENS = ("<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
                  "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")


def build_tiny_kimi_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Kimi-VL (``kimi_vl``): MoonViT (patches packed as in Qwen2-VL, a learned
    2D position table interpolated to each image, 2D RoPE, 2x2 merging) and a
    ``deepseek_v3`` text model (multi-head latent attention; a dense layer, then a
    mixture-of-experts layer of four routed experts and a shared one). Real: 14 px
    patches, up to 4096 patches an image at its aspect ratio (sizes cropped to 28 px
    multiples); tiny: 8 px patches, up to 64 (32x32 px -> 16 patches -> 4 tokens). An
    image is ``<|media_start|>image<|media_content|>``, ``<|media_pad|>`` a token,
    ``<|media_end|>``."""
    eos, vocab, ids = _start(out, KIMI_VL_TOKENS)
    config = {
        "model_type": "kimi_vl", "architectures": ["KimiVLForConditionalGeneration"],
        "media_placeholder_token_id": ids["<|media_pad|>"], "vocab_size": vocab,
        "eos_token_id": eos, "pad_token_id": 0, "ignore_index": -100,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "deepseek_v3", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 2.446,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
            "topk_group": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 800000.0,
            "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "moonvit", "depth": 2, "embed_dim": 32, "hidden_size": 32,
            "num_heads": 2, "intermediate_size": 64, "patch_size": 8,
            "init_pos_emb_height": 8, "init_pos_emb_width": 8,
            "merge_kernel_size": [2, 2], "num_channels": 3,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "KimiVLImageProcessor", "processor_class": "KimiVLProcessor",
        "patch_size": 8, "in_token_limit": 64, "pad_input": False,
        "merge_kernel_size": [2, 2], "image_mean": CLIP_MEAN, "image_std": CLIP_STD})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


GLM4V_TOKENS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>",
                "<|video|>", "<|end_of_video|>")


def build_tiny_glm4v(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny GLM-4.1V (``glm4v``): Qwen2-VL's packed patches (two frames a patch, 2x2
    merging by a strided conv) with a learned position table interpolated to the image,
    and a ``glm4v_text`` model (GLM-4, half the head rotated, M-RoPE over time, height
    and width). Real: 14 px patches, images resized to multiples of 28 px between 112x112
    and about 3000x3000; tiny: 8 px patches, multiples of 16 px from 32x32 to 64x64
    (32x32 px -> 4 tokens). An image is ``<|begin_of_image|>``, ``<|image|>`` a token,
    ``<|end_of_image|>``."""
    eos, vocab, ids = _start(out, GLM4V_TOKENS)
    config = {
        "model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"],
        "vocab_size": vocab, "hidden_size": 64, "pad_token_id": 0, "eos_token_id": [eos],
        "image_token_id": ids["<|image|>"], "image_token_index": ids["<|image|>"],
        "video_token_id": ids["<|video|>"], "video_token_index": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "vision_start_token_id": ids["<|begin_of_image|>"],
        "vision_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"], "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "glm4v_text", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000,
            "attention_bias": True, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096, "eos_token_id": [eos], "pad_token_id": 0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        },
        "vision_config": {
            "model_type": "glm4v", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "patch_size": 8, "image_size": 32, "in_channels": 3,
            "out_hidden_size": 64, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "rms_norm_eps": 1e-5, "attention_bias": False, "hidden_act": "silu",
        },
    }
    _preprocessor(out, {
        "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor",
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}, "patch_size": 8,
        "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


PALIGEMMA_TOKENS = ("<image>", "<bos>")


def build_tiny_paligemma(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny PaliGemma 2 (``paligemma``): a SigLIP tower, a linear projector, a Gemma 2
    text model, with the prefix (image and prompt) attended bidirectionally. A fixed
    square image, ``<image>`` a token before ``<bos>``, the prompt and a newline, and no
    begin or end tokens. Real: 224 px (14 px patches: 256 tokens; 448 and 896 px
    variants); tiny: 32 px (8 px patches: 16 tokens)."""
    eos, vocab, ids = _start(out, PALIGEMMA_TOKENS, {"bos_token": "<bos>",
                                                      "image_token": "<image>"})
    config = {
        "model_type": "paligemma", "architectures": ["PaliGemmaForConditionalGeneration"],
        "image_token_index": ids["<image>"], "vocab_size": vocab, "hidden_size": 64,
        "projection_dim": 64, "pad_token_id": 0, "bos_token_id": ids["<bos>"],
        "eos_token_id": [eos], "torch_dtype": "float32",
        "text_config": {
            "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 32, "sliding_window": 4096,
            "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
            "num_image_tokens": 16,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "patch_size": 8, "image_size": 32, "projection_dim": 64,
            "num_image_tokens": 16, "layer_norm_eps": 1e-6,
        },
    }
    _preprocessor(out, {
        "image_processor_type": "SiglipImageProcessor", "processor_class": "PaliGemmaProcessor",
        "size": {"height": 32, "width": 32}, "image_seq_length": 16, "do_resize": True,
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": HALF, "image_std": HALF, "do_convert_rgb": True})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    embed = model.language_model.model.embed_tokens  # Gemma scales it up by sqrt(hidden)
    embed.weight = embed.weight * (0.2 / weight_scale)
    return save_model(out, model, config, eos, tied=True)


def build_tiny_llava(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny LLaVA 1.5 (``llava``): a CLIP tower (a class token; the second-to-last
    layer's patch features, the class token dropped), a two-layer MLP projector, a Llama
    text model. A fixed square image (shortest edge resized, centre-cropped), ``<image>``
    a token, no begin or end tokens. Real: 336 px (14 px patches: 576 tokens); tiny:
    32 px (8 px patches: 16 tokens)."""
    eos, vocab, ids = _start(out, ("<image>",), {"image_token": "<image>"})
    config = {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": ids["<image>"], "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2, "projector_hidden_act": "gelu", "vocab_size": vocab,
        "pad_token_id": 0, "eos_token_id": eos, "tie_word_embeddings": False,
        "image_seq_length": 16, "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
            "patch_size": 8, "projection_dim": 64, "num_channels": 3,
            "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu",
        },
    }
    _preprocessor(out, {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
        "do_resize": True, "do_center_crop": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "do_convert_rgb": True})
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": 8,
        "vision_feature_select_strategy": "default", "image_token": "<image>",
        "num_additional_image_tokens": 1}))
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


def build_tiny_moondream3(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Moondream 3 (``moondream3``): a SigLIP-shaped tower on a global crop and
    overlapping local crops (their features stitched and pooled back to one grid, then
    concatenated with the global crop's), an MLP projector, and a text model of a dense
    layer then a mixture-of-experts one. No image tokens: the prompt is BOS, one
    placeholder id a vision token (the model overwrites positions 1 to n), then the text;
    the prefix (BOS and image) attends bidirectionally. Real: 378 px crops (14 px patches:
    729 tokens, which mlx-vlm's processor writes whatever the config), up to 12 local
    crops; tiny: 32 px crops (8 px patches: 16 tokens)."""
    eos, vocab, _ = _start(out, ())
    config = {
        "model_type": "moondream3", "architectures": ["HfMoondream"],
        "eos_token_id": 0, "bos_token_id": 0, "torch_dtype": "float32",
        "text_config": {
            "model_type": "moondream3", "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "vocab_size": vocab, "max_position_embeddings": 4096,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
            "rope_theta": 1500000.0, "rope_dim": 16, "rms_norm_eps": 1e-5,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_start_layer": 1, "attention_bias": True, "prefix_attn": 17,
        },
        "vision_config": {
            "model_type": "moondream3_vision", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8,
            "crop_size": 32, "max_crops": 12, "overlap_margin": 1, "in_channels": 3,
            "proj_inner_dim": 128, "proj_out_dim": 64, "attention_bias": True,
            "layer_norm_eps": 1e-6,
        },
    }
    _preprocessor(out, {"crop_size": 32, "max_crops": 12, "overlap_margin": 1,
                        "resample": 3, "image_mean": HALF, "image_std": HALF})
    model = _random_model(config, seed)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


# Each family's builder, keyed by its checkpoint's ``model_type``.
ZOO_BUILDERS: dict[str, Callable[..., Path]] = {
    "gemma4": build_tiny_gemma4,
    "gemma3n": build_tiny_gemma3n,
    "smolvlm": build_tiny_smolvlm,
    "idefics3": build_tiny_idefics3,
    "llama4": build_tiny_llama4,
    "mistral3": build_tiny_ministral3,
    "internvl_chat": build_tiny_internvl,
    "phi4-siglip": build_tiny_phi4_siglip,
    "kimi_vl": build_tiny_kimi_vl,
    "glm4v": build_tiny_glm4v,
    "paligemma": build_tiny_paligemma,
    "llava": build_tiny_llava,
    "moondream3": build_tiny_moondream3,
}
