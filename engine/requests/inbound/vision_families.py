"""Every vision-language family a user loads, and what the engine does with its images.

One row per family of the vision library (mlx-vlm) that users load: its ``model_type``
values, whether its images are served, and where they are not, why. Served families have
a ``VisionFormat`` (``vision_formats.FORMATS``) and are proven exact against mlx-vlm's
own generation by the vision zoo (``tests/engine/test_vision_zoo.py``), which also proves
each refusal; docs/models.md's vision table is written from this table
(``python -m testkit.vision_zoo_docs``).

A refused family's checkpoint still loads for text where mlx-lm has its text model
(``Support.TEXT``); each image part is then refused with ``UnsupportedMediaError`` naming
the family and this reason. Where mlx-lm has no text model for it (``Support.NONE``) the
load itself fails with ``UnsupportedModelError`` naming the family and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Support(Enum):
    """What a family's checkpoint gets."""

    IMAGES = "images and text"
    TEXT = "text; images refused"
    NONE = "not loaded"


@dataclass(frozen=True)
class VisionFamily:
    """A family: its name, its checkpoints' ``model_type`` values, what it gets, why not
    more (None where its images are served), and whether its audio is read too (where a
    checkpoint has an audio tower: ``vision_formats.AUDIO_FAMILIES``)."""

    name: str
    model_types: tuple[str, ...]
    support: Support
    reason: str | None = None
    audio: bool = False


_NOT_WRITTEN = "are not written by this engine yet"

FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("Qwen3.5 (dense and MoE)", ("qwen3_5", "qwen3_5_moe"), Support.IMAGES),
    VisionFamily("Qwen3-VL", ("qwen3_vl",), Support.IMAGES),
    VisionFamily("Qwen2.5-VL", ("qwen2_5_vl",), Support.IMAGES),
    VisionFamily("Qwen2-VL", ("qwen2_vl",), Support.IMAGES),
    VisionFamily("Gemma 3", ("gemma3",), Support.IMAGES),
    VisionFamily("Mistral 3 (Pixtral's tower; Ministral 3 text too)", ("mistral3",),
                 Support.IMAGES),
    VisionFamily("LFM2-VL", ("lfm2-vl", "lfm2_vl"), Support.IMAGES),
    VisionFamily("LLaVA", ("llava",), Support.IMAGES),
    VisionFamily("SmolVLM / Idefics3", ("smolvlm", "idefics3"), Support.IMAGES),
    VisionFamily("InternVL", ("internvl_chat",), Support.IMAGES),
    VisionFamily("Gemma 4", ("gemma4",), Support.IMAGES, audio=True),
    VisionFamily("Gemma 3n", ("gemma3n",), Support.TEXT,
                 "Gemma 3n's image and audio blocks (256 soft tokens from its fixed 294M "
                 f"MobileNetV5 tower; audio from its conformer) {_NOT_WRITTEN}"),
    VisionFamily("Llama 4", ("llama4",), Support.IMAGES),
    VisionFamily("Phi-4 multimodal", ("phi4-siglip", "phi4mm"), Support.NONE,
                 "Phi-4 multimodal: mlx-lm has no text model for it, and its image "
                 "placeholder (one id, -200) expands into the image's features, changing "
                 "the prompt's length"),
    VisionFamily("Kimi-VL", ("kimi_vl",), Support.TEXT,
                 "Kimi-VL's image blocks (<|media_start|>image<|media_content|>, "
                 f"<|media_pad|> per merged patch, <|media_end|>) {_NOT_WRITTEN}; its text "
                 "side loads from text_config (mlx-lm's kimi_vl module leaves kv_b_proj whole, "
                 "which its deepseek_v3 splits)"),
    VisionFamily("GLM-4V", ("glm4v",), Support.NONE,
                 "GLM-4V: mlx-lm has no text model for it (glm4v_text: GLM-4 with M-RoPE on "
                 "half of each head)"),
    VisionFamily("PaliGemma", ("paligemma",), Support.NONE,
                 "PaliGemma: its language model attends to the image and prompt both ways "
                 "(a prefix LM), which a causal batch does not reproduce; mlx-lm has no "
                 "model for it"),
    VisionFamily("Moondream", ("moondream3", "moondream2"), Support.NONE,
                 "Moondream: mlx-lm has no text model for it, and its image has no token "
                 "(features overwrite the positions after BOS, attended both ways)"),
)


def family_of(model_type: str) -> VisionFamily | None:
    """The family a checkpoint's ``model_type`` belongs to (None: not in the table)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return None


def images_refused_because(model_type: str) -> str:
    """Why a vision checkpoint of ``model_type`` gets no images: its family's reason, or
    that the family is not one this engine reads."""
    family = family_of(model_type)
    if family is not None and family.reason:
        return family.reason
    served = ", ".join(f.name for f in FAMILIES if f.support is Support.IMAGES)
    return (f"the family is not one whose images this engine reads (those are: {served}); "
            "send text only")


def load_refused_because(model_type: str) -> str | None:
    """Why a checkpoint of ``model_type`` is not loaded at all (None: it may be)."""
    family = family_of(model_type)
    return family.reason if family is not None and family.support is Support.NONE else None
