"""Build a tiny Gemma 3 vision-language model directory offline, in seconds.

The checkpoint has Gemma 3's real layout (``model_type: gemma3``: a SigLIP vision tower,
the pooling projector, a ``gemma3_text`` language model), so ``mlx_lm.load`` reads its
text side and ``mlx_vlm`` its whole model (and its processor: ``load_processor``). Weights
are random (seeded); the tokenizer is the tiny model's (``tiny_model``), trained on whole
files so that runs of newlines are tokens as in Gemma's own vocabulary, with Gemma 3's
three image tokens added, and its ChatML template. Nothing is downloaded.
``fit_colour_namer`` then fits it for seconds to name an image's colour, so a test can
show that an image's content reaches the answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# The answers the fitted model gives, one per colour it is shown.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220),
    "yellow": (235, 220, 30),
}


def vlm_config(n_vocab: int, eos: int, image_token: int, *, hidden: int = 64,
               layers: int = 2, image_size: int = 32, patch: int = 8,
               tokens_per_image: int = 4, vision_hidden: int = 32,
               vision_layers: int = 2) -> dict[str, Any]:
    """A Gemma 3 VLM config.json at toy size (``vocab_size`` rounded up to 64)."""
    vocab = (n_vocab + 63) // 64 * 64
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "image_token_index": image_token,
        "boi_token_index": image_token - 1,
        "eoi_token_index": image_token + 1,
        "mm_tokens_per_image": tokens_per_image,
        "pad_token_id": 0,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": hidden * 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": vocab,
            "query_pre_attn_scalar": 32, "sliding_window": 512, "sliding_window_pattern": 2,
            "mm_tokens_per_image": tokens_per_image, "max_position_embeddings": 4096,
            "rope_global_base_freq": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": vision_hidden,
            "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
            "num_attention_heads": 2, "patch_size": patch,
            "image_size": image_size, "num_channels": 3, "layer_norm_eps": 1e-6,
        },
    }


def build_tiny_vlm(out: Path, *, seed: int = 0, weight_scale: float = 4.0,
                   **sizes: int) -> Path:
    """Write the model directory to ``out`` (created) and return it; ``sizes`` override
    ``vlm_config``'s (the bench builds a larger one)."""
    import mlx.core as mx
    from mlx_vlm.models import gemma3

    tokenizer = tiny_vlm_tokenizer(out, IMAGE_TOKENS, {
        "boi_token": IMAGE_TOKENS[0], "image_token": IMAGE_TOKENS[1],
        "eoi_token": IMAGE_TOKENS[2]}, paragraphs=True)
    eos = tokenizer.token_to_id("<|im_end|>")
    config = vlm_config(tokenizer.get_vocab_size(with_added_tokens=True), eos,
                        tokenizer.token_to_id(IMAGE_TOKENS[1]), **sizes)
    side = config["vision_config"]["image_size"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": side, "width": side}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False}))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma3Processor",
        "image_seq_length": config["mm_tokens_per_image"]}))
    mx.random.seed(seed)
    model = gemma3.Model(model_config(config))
    # As in tiny_model: larger weights give varied greedy continuations; the embedding,
    # which Gemma scales up by sqrt(hidden), smaller (at 1x every token decodes alike).
    scale_language(model, weight_scale)
    embed = model.language_model.model.embed_tokens
    embed.weight = embed.weight * (0.2 / weight_scale)
    # A patch's colour, not its position, should lead the tower's features.
    patches = model.vision_tower.vision_model.embeddings.patch_embedding
    patches.weight = patches.weight * 8.0
    # mlx-vlm starts the projection at all ones (every hidden unit alike): random instead.
    projector = model.multi_modal_projector
    shape = projector.mm_input_projection_weight.shape
    projector.mm_input_projection_weight = mx.random.normal(shape) * shape[0] ** -0.5
    return save_model(out, model, config, eos, tied=True)


def tiny_vlm_tokenizer(out: Path, image_tokens: Sequence[str], config: dict[str, Any], *,
               paragraphs: bool = False) -> Any:
    """The tiny model's tokenizer with ``image_tokens`` added, saved to ``out``;
    ``paragraphs``: trained on whole files, not lines (newline runs become tokens)."""
    from tokenizers import AddedToken

    from testkit.tiny_model import CHAT_TEMPLATE, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer: Any = _paragraph_tokenizer(2048) if paragraphs else train_tokenizer(2048)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in image_tokens])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE, **config}, indent=2))
    return tokenizer


def _paragraph_tokenizer(vocab_size: int) -> Any:
    """``tiny_model.train_tokenizer``'s BPE trained on whole files: its merges then span
    line ends, so ``"\n\n"`` and ``"\n\n\n"`` are tokens of their own, as in real
    vocabularies (where an image block's blank lines merge with the text's newlines)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from testkit.tiny_model import SPECIAL_TOKENS, TOOL_TOKENS, corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in corpus()]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def model_config(config: dict[str, Any]) -> Any:
    """mlx-vlm's config object for a family (its sub-configs built too, as its loader does)."""
    import importlib

    family = str(config["model_type"]).replace("-", "_")
    module = importlib.import_module(f"mlx_vlm.models.{family}")
    built = module.ModelConfig.from_dict(config)
    built.text_config = module.TextConfig.from_dict(config["text_config"])
    built.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    return built


MISTRAL3_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def build_tiny_mistral3(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Mistral 3 VLM (Pixtral's tower, 2x2 patch merging, a Mistral text model):
    images keep their aspect ratio, up to 64 px on the longest edge, 16 px a token."""
    import mlx.core as mx
    from mlx_vlm.models import mistral3

    tokenizer = tiny_vlm_tokenizer(out, MISTRAL3_TOKENS, {})
    eos = tokenizer.token_to_id("<|im_end|>")
    vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    config = {
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": tokenizer.token_to_id(MISTRAL3_TOKENS[0]),
        "spatial_merge_size": 2, "vision_feature_layer": -1, "vocab_size": vocab,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "eos_token_id": eos, "torch_dtype": "float32",
        "text_config": {
            "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 1e6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 2,
            "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16,
            "image_size": 64, "patch_size": 8, "rope_theta": 10000.0,
        },
    }
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 64}, "patch_size": 8, "do_rescale": True,
        "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5]}))
    mx.random.seed(seed)
    model = mistral3.Model(model_config(config))
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


def scale_language(model: Any, weight_scale: float) -> None:
    """As in tiny_model: the language model's matrices larger, for varied greedy text."""
    from mlx.utils import tree_map

    language = model.language_model
    language.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p,
                             language.parameters()))


def save_model(out: Path, model: Any, config: dict[str, Any], eos: int, *,
           tied: bool = False) -> Path:
    """Write the weights (without an output head where it is ``tied``) and the configs."""
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    save_weights(out, _tied(weights) if tied else weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def _tied(weights: dict[str, Any]) -> dict[str, Any]:
    """Gemma ties its output head to the embedding: the checkpoint has no head of its own."""
    return {k: v for k, v in weights.items() if k != "language_model.lm_head.weight"}


def save_weights(out: Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    mx.eval(list(weights.values()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def solid_image(rgb: tuple[int, int, int], size: int = 32, *, noise: int = 0,
                seed: int = 0) -> bytes:
    """A PNG of one colour (with optional per-pixel noise), as bytes."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.empty((size, size, 3), np.int16)
    pixels[:] = rgb
    if noise:
        pixels += np.random.default_rng(seed).integers(-noise, noise + 1, pixels.shape,
                                                       dtype=np.int16)
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


# What the fitted model is asked, "\x00" where the image goes: a question beside an image,
# and an agent's turn whose tool returned a screenshot.
FIT_CONVERSATIONS: tuple[tuple[dict[str, Any], ...], ...] = (
    ({"role": "user", "content": "\x00What colour is this?"},),
    ({"role": "user", "content": "\x00Name the colour."},),
    ({"role": "user", "content": "What colour is the screenshot?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "take_screenshot", "arguments": {}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "\x00"}),
)


def fit_colour_namer(model_dir: Path, *, steps: int = 90,
                     conversations: Sequence[Sequence[dict[str, Any]]] = FIT_CONVERSATIONS,
                     ) -> Path:
    """Fit the tiny VLM in place to answer an image's colour name (``COLOURS``).

    Trains on the prompts the engine itself builds for ``conversations`` (the chat
    template's text, the image block where the image is), so the fitted behaviour is the
    one the doors see.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model
    from transformers import PreTrainedTokenizerFast

    from engine.requests.inbound.images import decoded_image  # first: it loads the fast BLAS
    from engine.requests.inbound.vision_formats import vision_format

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    fmt = vision_format(config, tokenizer)
    assert fmt is not None
    model = load_model(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = {name: [*tokenizer.encode(name, add_special_tokens=False), end]
               for name in COLOURS}
    width = max(len(a) for a in answers.values())
    batches = []  # one per question: every colour, twice, in one batch of equal lengths
    for k, conversation in enumerate(conversations):
        head = tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                             add_generation_prompt=True)
        before, after = head.split("\x00")
        rows, weights, pixels = [], [], []
        for name, rgb in COLOURS.items():
            answer = answers[name]
            for seed in range(2):
                image = decoded_image(solid_image(rgb, noise=12, seed=seed + 10 * k), "fit")
                # The block written into the text and encoded whole, as the engine does.
                ids = tokenizer.encode(before + fmt.text(fmt.read(image)) + after,
                                       add_special_tokens=False)
                rows.append(ids + answer + [end] * (width - len(answer)))
                weights.append([0.0] * (len(ids) - 1) + [1.0] * len(answer)
                               + [0.0] * (width - len(answer)))
                pixels.append(fmt.pixels(image)[0])
        full = mx.array(rows)
        batches.append((full[:, :-1], full[:, 1:], mx.array(np.stack(pixels)),
                        mx.array(weights)))

    def loss_fn(m: Any, ids: mx.array, targets: mx.array, pixels: mx.array,
                weight: mx.array) -> mx.array:
        embeds = m.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape)).inputs_embeds
        text = m.language_model.model
        logits = text.embed_tokens.as_linear(text(ids, inputs_embeds=embeds))  # tied head
        losses = nn.losses.cross_entropy(logits, targets, reduction="none")
        return (losses * weight).sum() / weight.sum()

    optimizer = optim.Adam(learning_rate=4e-3)
    step = nn.value_and_grad(model, loss_fn)
    for n in range(steps):
        loss, grads = step(model, *batches[n % len(batches)])
        if os.environ.get("FIT_DEBUG"):
            print(n, loss.item())
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    save_weights(model_dir, _tied(dict(tree_flatten(model.parameters()))))
    return model_dir


def vision_library_tokens(model_dir: Path, prompt_ids: Sequence[int],
                          pixels: Sequence[Any], max_tokens: int,
                          extras: Sequence[dict[str, Any]] = ()) -> list[int]:
    """Greedy tokens of mlx-vlm's own single-request generation for the same prompt ids and
    pixel values (its ``generate_step``, with its own language model): the reference an
    image row of the engine must equal."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.utils import load_model

    model = load_model(Path(model_dir))
    ids = mx.array([list(prompt_ids)])
    kwargs: dict[str, Any] = {}
    config = model.config
    if config.model_type == "gemma4":
        # Its processor's token types (1 image, 2 video, 3 audio), which its language
        # model reads for the images' two-way attention.
        types = np.zeros(len(prompt_ids), np.int32)
        for kind, name in enumerate(("image_token_id", "video_token_id", "audio_token_id")):
            if getattr(config, name, None) is not None:
                types[np.array(prompt_ids) == getattr(config, name)] = kind + 1
        kwargs["mm_token_type_ids"] = mx.array(types[None])
        if pixels and len({p.shape for p in pixels}) > 1:  # sizes apart: a list, as there
            pixels = [p[0] for p in pixels]
            kwargs["pixel_values"] = [mx.array(p) for p in pixels]
    videos = [(p, e) for p, e in zip(pixels, extras) if "video_grid_thw" in e]
    if videos:  # a video's blocks: the tower's video input, its groups as one grid
        pixels = [p for p, e in zip(pixels, extras) if "video_grid_thw" not in e]
        extras = [e for e in extras if "video_grid_thw" not in e]
        grids = [list(g) for _, e in videos for g in e["video_grid_thw"]]
        merged = [grids[0]]
        for grid in grids[1:]:  # one video's groups, read as one (t, h, w)
            if grid[1:] == merged[-1][1:] and grid[0] == 1:
                merged[-1] = [merged[-1][0] + 1, *grid[1:]]
            else:
                merged.append(grid)
        kwargs["pixel_values_videos"] = mx.array(np.concatenate([p for p, _ in videos]))
        kwargs["video_grid_thw"] = mx.array(np.array(merged))
    if "pixel_values" in kwargs:
        values = kwargs.pop("pixel_values")
    elif pixels and pixels[0].ndim == 4:  # pictures, padded at the bottom and right
        height = max(p.shape[2] for p in pixels)
        width = max(p.shape[3] for p in pixels)
        values = mx.array(np.concatenate([
            np.pad(p, ((0, 0), (0, 0), (0, height - p.shape[2]), (0, width - p.shape[3])))
            for p in pixels]))
    elif pixels and pixels[0].ndim == 5:  # (1, views, ...) each: one prompt's views
        values = mx.array(np.concatenate(list(pixels), axis=1))
    elif pixels:  # patches or views: one image's after another's
        values = mx.array(np.concatenate(list(pixels)))
    else:
        values = None
    for extra in extras:  # the tower's other inputs, one entry per image
        for key, value in extra.items():
            if isinstance(value, int):  # one value for every image (InternVL's token id)
                kwargs[key] = value
                continue
            kwargs.setdefault(key, []).extend(list(value))
    for key in ("image_grid_thw", "pixel_attention_mask", "spatial_shapes"):
        if key in kwargs:
            kwargs[key] = mx.array(np.array(kwargs[key]))
    return vision_library_greedy(model, ids, values, max_tokens, **kwargs)


def vision_library_greedy(model: Any, ids: Any, pixels: Any, max_tokens: int,
                          **inputs: Any) -> list[int]:
    """``max_tokens`` greedy tokens of mlx-vlm's ``generate_step`` on its loaded ``model``
    for prompt ``ids`` (1, n), ``pixels`` (or None) and the tower's other ``inputs``."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    out: list[int] = []
    for token, _ in generate_step(ids, model, pixels, mx.ones(ids.shape, mx.int32),
                                  max_tokens=max_tokens, temperature=0.0, **inputs):
        out.append(int(token))
        if len(out) >= max_tokens:
            break
    return out


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_qwen2_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Qwen2-VL (its patch tower with 2x2 merging, a Qwen2 text model with M-RoPE):
    images resized to multiples of 28 px, 56x56 to 112x112, one token per 28 px square."""
    return _tiny_qwen_vl(out, "qwen2_vl", {
        "model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64,
        "num_heads": 2, "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    }, seed=seed, weight_scale=weight_scale)


def build_tiny_qwen2_5_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Qwen2.5-VL: Qwen2-VL's text side and image tokens, its own tower (RMSNorm,
    SwiGLU blocks, attention within 56 px windows in the first block and over the whole
    image in the last), the same image sizes as ``build_tiny_qwen2_vl``."""
    return _tiny_qwen_vl(out, "qwen2_5_vl", {
        "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
        "out_hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
        "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2,
    }, seed=seed, weight_scale=weight_scale)


def _tiny_qwen_vl(out: Path, family: str, vision: dict[str, Any], *, seed: int,
                  weight_scale: float) -> Path:
    """A tiny Qwen-VL of ``family`` (mlx-vlm's module) with the ``vision`` tower config."""
    import importlib

    import mlx.core as mx

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    tokenizer = tiny_vlm_tokenizer(out, QWEN_VL_TOKENS, {})
    eos = tokenizer.token_to_id("<|im_end|>")
    vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_VL_TOKENS}
    config = {
        "model_type": family, "architectures": [
            "Qwen2VLForConditionalGeneration" if family == "qwen2_vl"
            else "Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": False, "eos_token_id": eos, "bos_token_id": None,
        "torch_dtype": "float32", "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_config": vision,
    }
    (out / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5]}))
    # Videos: two frames a second, each frame 56x56 to 112x112 px (4 to 16 tokens a group).
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "fps": 2.0, "min_frames": 4, "max_frames": 16, "min_pixels": 56 * 56,
        "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2}))
    mx.random.seed(seed)
    built = module.ModelConfig.from_dict(dict(config))
    built.text_config = module.TextConfig.from_dict(built.text_config)
    built.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(built)
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


LFM2_VL_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                  *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)
                    if r * c <= 10))


def build_tiny_lfm2_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny LFM2-VL (a SigLIP2 tower on packed 16 px patches, pixel-unshuffle by 2, an
    LFM2 text model of a conv and an attention layer): 4 to 16 tokens a view, images over
    about 180x180 px in 64 px tiles and a thumbnail."""
    import mlx.core as mx
    from mlx_vlm.models import lfm2_vl

    tokenizer = tiny_vlm_tokenizer(out, LFM2_VL_TOKENS, {})
    eos = tokenizer.token_to_id("<|im_end|>")
    vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    layout = {"encoder_patch_size": 16, "downsample_factor": 2, "min_image_tokens": 4,
              "max_image_tokens": 16, "tile_size": 64, "max_num_patches": 64,
              "max_pixels_tolerance": 2.0}
    config = {
        "model_type": "lfm2-vl", "architectures": ["Lfm2VlForConditionalGeneration"],
        "image_token_index": tokenizer.token_to_id("<image>"), "eos_token_id": eos,
        "projector_hidden_size": 64, "projector_bias": True, "vision_feature_layer": -1,
        "do_image_splitting": True, "use_thumbnail": True, "torch_dtype": "float32",
        **layout,
        "text_config": {
            "model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 1e6,
            "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
            "block_ff_dim": 256, "block_auto_adjust_ff_dim": False, "conv_dim": 64,
            "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
            "conv_dim_out": 64, "layer_types": ["conv", "full_attention"],
            "full_attn_idxs": [1], "tie_embedding": True, "tie_word_embeddings": True,
        },
        "vision_config": {
            "model_type": "siglip2_vision_model", "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_channels": 3, "patch_size": 16, "num_patches": 64,
            "layer_norm_eps": 1e-6, "vision_use_head": False,
        },
    }
    (out / "preprocessor_config.json").write_text(json.dumps({
        **layout, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255, "do_image_splitting": True, "use_thumbnail": True}))
    mx.random.seed(seed)
    model = lfm2_vl.Model(model_config(config))
    scale_language(model, weight_scale)
    return save_model(out, model, config, eos)


# Qwen3-VL / Qwen3.5's tower: 16 px patches merged 2x2 (one token a 32 px square), a
# learned position grid interpolated to the image's (here 4x4 patches: 64 px).
_QWEN3_TOWER = {"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                "out_hidden_size": 64, "num_heads": 2, "patch_size": 16,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                "num_position_embeddings": 16}


def build_tiny_qwen3_vl(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Qwen3-VL: its tower (16 px patches, interpolated position grid) with
    deepstack (the first block's merged features added to the text model's first layer's
    image positions), a Qwen3 text model with interleaved M-RoPE; images 64x64 to 128x128,
    one token per 32 px square."""
    text = {"model_type": "qwen3_vl_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 5e6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5],
                             "mrope_interleaved": True}}
    return _tiny_qwen3(out, "qwen3_vl", "Qwen3VLForConditionalGeneration", text,
                       {**_QWEN3_TOWER, "model_type": "qwen3_vl",
                        "deepstack_visual_indexes": [0]}, seed=seed,
                       weight_scale=weight_scale)


def build_tiny_qwen3_5(out: Path, *, seed: int = 0, weight_scale: float = 4.0,
                       moe: bool = False) -> Path:
    """A tiny Qwen3.5 (``moe``: Qwen3.5-MoE): Qwen3-VL's tower without deepstack, a hybrid
    text model (gated delta-net layers, then one attention layer with partial interleaved
    M-RoPE); the same image sizes as ``build_tiny_qwen3_vl``."""
    family = "qwen3_5_moe" if moe else "qwen3_5"
    text: dict[str, Any] = {
        "model_type": f"{family}_text", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "linear_num_value_heads": 2, "linear_num_key_heads": 1,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True, "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25}}
    if moe:
        text.update({"num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32})
    architecture = ("Qwen3_5MoeForConditionalGeneration" if moe
                    else "Qwen3_5ForConditionalGeneration")
    return _tiny_qwen3(out, family, architecture, text,
                       {**_QWEN3_TOWER, "model_type": family}, seed=seed,
                       weight_scale=weight_scale)


def build_qwen3_5_moe(out: Path, *, seed: int = 0, weight_scale: float = 4.0) -> Path:
    """A tiny Qwen3.5-MoE (``build_tiny_qwen3_5`` with routed experts)."""
    return build_tiny_qwen3_5(out, seed=seed, weight_scale=weight_scale, moe=True)


def _tiny_qwen3(out: Path, family: str, architecture: str, text: dict[str, Any],
                vision: dict[str, Any], *, seed: int, weight_scale: float) -> Path:
    """A tiny Qwen3-generation VLM of ``family`` with its ``text`` and ``vision`` configs."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_map

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    tokenizer = tiny_vlm_tokenizer(out, QWEN_VL_TOKENS, {})
    eos = tokenizer.token_to_id("<|im_end|>")
    vocab = (tokenizer.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_VL_TOKENS}
    config = {
        "model_type": family, "architectures": [architecture],
        "text_config": {**text, "vocab_size": vocab, "eos_token_id": eos},
        "vision_config": vision, "vocab_size": vocab, "eos_token_id": eos,
        "torch_dtype": "float32", "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, "patch_size": 16,
        "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5]}))
    # Videos: two frames a second, the whole clip's pixels 64x64x2 to 64x64x8 px.
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "fps": 2.0, "min_frames": 4, "max_frames": 16,
        "size": {"shortest_edge": 2 * 64 * 64, "longest_edge": 8 * 64 * 64},
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}))
    mx.random.seed(seed)
    built = module.ModelConfig.from_dict(dict(config))
    built.text_config = module.TextConfig.from_dict(config["text_config"])
    built.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(built)
    scale_language(model, weight_scale)
    for merger in getattr(model.vision_tower, "deepstack_merger_list", []):
        # Deepstack's rows count as much as the image's own: a test that dropped them fails.
        merger.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, merger.parameters()))
    return save_model(out, model, config, eos)
