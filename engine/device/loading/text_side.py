"""A vision checkpoint's text side, where mlx-lm has no model for the checkpoint's family
but has one for its language model (Idefics3 / SmolVLM's Llama, LLaVA's, PaliGemma's Gemma).

Such a checkpoint's ``config.json`` names the whole model (``model_type: smolvlm``) and
nests the language model's config under ``text_config``; its weights keep the language
model under a prefix (``model.text_model.``, ``language_model.``) beside the tower's. The
text side is built from ``text_config`` with mlx-lm's own module for it, from the
language-model tensors with the prefix taken off; the tower's tensors are left unread
(images for these families are refused by name: ``vision_families``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# Where VLM checkpoints keep their language model (first match wins), and what the text
# model calls the same place; a name left outside ``model.``/``lm_head.`` goes under
# ``model.`` (mlx-vlm's own layout: ``language_model.layers.0...``).
_PREFIXES = (("model.text_model.", "model."), ("model.language_model.", "model."),
             ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
             ("language_model.", ""))
# The tower's and projector's tensors (not the text model's).
_TOWER_PARTS = frozenset({"vision_model", "vision_tower", "visual", "multi_modal_projector",
                          "connector", "mm_projector", "vision", "image_newline", "mlp1"})


# Families mlx-lm has a module for that cannot build their checkpoints, whose language
# model mlx-lm's own module for it builds: Kimi-VL (mlx-lm's kimi_vl leaves kv_b_proj
# whole; its deepseek_v3 splits it as its attention layers take it).
_TEXT_SIDE_PREFERRED = frozenset({"kimi_vl"})


def text_side_preferred(config: dict[str, Any]) -> bool:
    """Load the checkpoint's text side from ``text_config`` even where mlx-lm has a module
    for the whole family (one known not to build it)."""
    return config.get("model_type") in _TEXT_SIDE_PREFERRED


def text_config_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The language model's config where mlx-lm has a module for it (None: none nested,
    or mlx-lm has none for it either)."""
    nested = config.get("text_config", config.get("llm_config"))  # InternVL: llm_config
    if not isinstance(nested, dict) or not isinstance(nested.get("model_type"), str):
        return None
    try:
        importlib.import_module(f"mlx_lm.models.{nested['model_type']}")
    except ImportError:
        return None
    return nested


def text_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The language model's tensors under the text model's names (the tower's dropped)."""
    kept: dict[str, Any] = {}
    for name, value in weights.items():
        if _TOWER_PARTS.intersection(name.split(".")[:3]):
            continue
        for prefix, replacement in _PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        if not name.startswith(("model.", "lm_head.")):  # the vision library's own layout
            name = "model." + name
        kept[name] = value
    return kept


def load_text_side(path: Path, text_config: dict[str, Any]) -> tuple[Any, Any]:
    """(model, tokenizer): the text side built by mlx-lm's module for ``text_config``."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_model

    module = importlib.import_module(f"mlx_lm.models.{text_config['model_type']}")

    class TextSide(module.Model):  # type: ignore[misc, name-defined]
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            own = text_weights(weights)
            found = getattr(super(), "sanitize", None)
            return found(own) if found is not None else own

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        return TextSide, module.ModelArgs

    # The nested config's fields win over the whole model's (its vocab, its eos).
    model, config = load_model(Path(path), model_config=dict(text_config),
                               get_model_classes=classes)
    return model, load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
