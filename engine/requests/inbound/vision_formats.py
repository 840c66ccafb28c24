"""How a vision-language model family reads an image: the tokens it takes, the pixels it wants.

A ``VisionFormat`` is everything the prompt side needs, read from the checkpoint's
``config.json`` (and ``preprocessor_config.json`` where present) and its tokenizer: the token
block one image occupies in the prompt (its image tokens are where the vision features go),
and the preprocessing that turns an image into the tower's pixel values. The tower itself
runs in ``engine.device.vision``. No mlx here (numpy and Pillow).

Families: Gemma 3 (SigLIP at a fixed square size, ``mm_tokens_per_image`` soft tokens between
``<start_of_image>`` and ``<end_of_image>``, each block set off by blank lines as Gemma 3's
processor writes it). Other vision checkpoints are loaded for text, and their images are
refused with ``UNSUPPORTED`` naming the family.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.requests.inbound.images import DecodedImage

SUPPORTED = ("gemma3",)


@dataclass(frozen=True)
class VisionFormat:
    """One family's image tokens and preprocessing."""

    family: str
    image_token: int  # the token whose embeddings the vision features replace
    block_ids: tuple[int, ...]  # what one image occupies in the prompt
    image_size: int  # square side the tower reads
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255

    @property
    def image_tokens(self) -> int:
        return sum(1 for t in self.block_ids if t == self.image_token)

    @property
    def key(self) -> str:
        """The preprocessing, as a feature-cache key's part: same key, same pixel values."""
        return f"{self.family}:{self.image_size}:{self.mean}:{self.std}:{self.rescale}"

    def pixels(self, image: DecodedImage) -> np.ndarray:
        """The tower's input: (3, size, size) float32, resized bilinearly and normalised."""
        from PIL import Image

        side = self.image_size
        resized = Image.fromarray(image.pixels).resize((side, side), Image.Resampling.BILINEAR)
        values = np.asarray(resized, dtype=np.float32) * np.float32(self.rescale)
        values = (values - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(values.transpose(2, 0, 1))


class UnsupportedVision(Exception):
    """A vision checkpoint whose family's images this engine does not read (yet)."""


def is_vision_config(config: Mapping[str, Any]) -> bool:
    """The checkpoint has a vision tower (its images need a ``VisionFormat``)."""
    return isinstance(config.get("vision_config"), Mapping)


def vision_format(config: Mapping[str, Any], tokenizer: Any,
                  model_path: Path | None = None) -> VisionFormat | None:
    """The checkpoint's format; None for a text-only model. Raises ``UnsupportedVision``
    for a vision checkpoint of a family not in ``SUPPORTED``."""
    if not is_vision_config(config):
        return None
    family = str(config.get("model_type"))
    if family not in SUPPORTED:
        raise UnsupportedVision(f"the model's family {family!r} has a vision tower, but "
                                f"its images are not read yet (families that take images: "
                                f"{', '.join(SUPPORTED)}); send text only")
    processor = _preprocessor(model_path)
    vision = config["vision_config"]
    image_token = int(config.get("image_token_index", 262144))
    boi = int(config.get("boi_token_index", 255999))
    eoi = int(config.get("eoi_token_index", 256000))
    count = int(config.get("mm_tokens_per_image",
                           config.get("text_config", {}).get("mm_tokens_per_image", 256)))
    blank = list(tokenizer.encode("\n\n", add_special_tokens=False))
    block = (*blank, boi, *([image_token] * count), eoi, *blank)
    size = processor.get("size", {})
    side = int(size.get("height", vision.get("image_size", 896))
               if isinstance(size, Mapping) else vision.get("image_size", 896))
    mean = tuple(float(v) for v in processor.get("image_mean", (0.5, 0.5, 0.5)))
    std = tuple(float(v) for v in processor.get("image_std", (0.5, 0.5, 0.5)))
    return VisionFormat(family, image_token, block, side, mean, std,  # type: ignore[arg-type]
                        float(processor.get("rescale_factor", 1 / 255)))


def _preprocessor(model_path: Path | None) -> dict[str, Any]:
    if model_path is None:
        return {}
    path = model_path / "preprocessor_config.json"
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}
