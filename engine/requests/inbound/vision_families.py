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
    """A family: its name, its checkpoints' ``model_type`` values, what it gets, and why
    not more (None where its images are served)."""

    name: str
    model_types: tuple[str, ...]
    support: Support
    reason: str | None = None


_TEXT_ONLY = "mlx-lm {version} has no text model for it"

FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("Qwen3.5 (dense and MoE)", ("qwen3_5", "qwen3_5_moe"), Support.IMAGES),
    VisionFamily("Qwen3-VL", ("qwen3_vl",), Support.IMAGES),
    VisionFamily("Qwen2.5-VL", ("qwen2_5_vl",), Support.IMAGES),
    VisionFamily("Qwen2-VL", ("qwen2_vl",), Support.IMAGES),
    VisionFamily("Gemma 3", ("gemma3",), Support.IMAGES),
    VisionFamily("Mistral 3 (Pixtral's tower)", ("mistral3",), Support.IMAGES),
    VisionFamily("LFM2-VL", ("lfm2-vl", "lfm2_vl"), Support.IMAGES),
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
