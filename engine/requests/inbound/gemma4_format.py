"""Gemma 4's image format: the image at its own aspect ratio within a patch budget, one soft
token per pooled square of patches.

As mlx-vlm's ``Gemma4ImageProcessor`` does it: the image is resized (bicubic) to the largest
size whose patches (``patch_size`` px) number at most ``max_soft_tokens`` pooled squares of
``pooling_kernel_size`` x ``pooling_kernel_size`` patches, each side a multiple of a pooled
square's side (a side that floors to nothing takes one square, the other its ratio, within
the budget's longest side); the pixels are rescaled only (``do_normalize`` is off in its
checkpoints) and channel-first, (1, 3, height, width); the tower computes the patches'
positions itself. The image's block is ``<|image>``, one ``<|image|>`` per pooled square,
``<image|>``, as its processor expands the template's ``<|image|>``. Its settings are the
processor's: ``processor_config.json``'s nested ``image_processor`` (which mlx-vlm reads;
its defaults otherwise: 16 px patches pooled 3x3, 280 tokens). No mlx here (numpy and
Pillow).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError
from engine.requests.inbound.images import DecodedImage
from engine.requests.inbound.vision_formats import (
    ImageTokens,
    VisionFormat,
    resized,
    spelling_of,
    token_id,
)


def gemma4_size(height: int, width: int, patch: int, max_patches: int,
                pooling: int) -> tuple[int, int]:
    """(height, width) Gemma 4's processor resizes an image to (its
    ``get_aspect_ratio_preserving_size``, exactly)."""
    factor = math.sqrt(max_patches * patch ** 2 / (height * width))
    side = pooling * patch
    target_height = math.floor(factor * height / side) * side
    target_width = math.floor(factor * width / side) * side
    if target_height == 0 and target_width == 0:
        raise ValueError("its processor would resize it to 0 x 0 px")
    longest = (max_patches // pooling ** 2) * side
    if target_height == 0:
        target_height = side
        target_width = min(math.floor(width / height) * side, longest)
    elif target_width == 0:
        target_width = side
        target_height = min(math.floor(height / width) * side, longest)
    return target_height, target_width


@dataclass(frozen=True)
class Gemma4Format(VisionFormat):
    """Gemma 4: the image's own aspect ratio, a soft token per pooled square of patches."""

    family: str
    image_token: int
    start_token: int  # <|image>
    end_token: int  # <image|>
    patch: int
    pooling: int
    max_soft_tokens: int
    resize: bool = True
    rescale: float = 1 / 255
    normalize: bool = False
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    spelling: tuple[tuple[int, str], ...] = ()

    def _size(self, image: DecodedImage) -> tuple[int, int]:
        """(height, width) the tower reads the image at."""
        width, height = image.size
        if not self.resize:
            return height, width
        try:
            return gemma4_size(height, width, self.patch,
                               self.max_soft_tokens * self.pooling ** 2, self.pooling)
        except ValueError as exc:
            raise InvalidRequestError(f"{image.at}: an image of {width}x{height} px cannot "
                                      f"be read by this model: {exc}", image.at) from exc

    def read(self, image: DecodedImage) -> ImageTokens:
        height, width = self._size(image)
        count = (height // self.patch) * (width // self.patch) // self.pooling ** 2
        return ImageTokens((self.start_token, *([self.image_token] * count), self.end_token))

    def pixels(self, image: DecodedImage) -> np.ndarray:
        height, width = self._size(image)
        values = resized(image, width, height, 3).astype(np.float32)  # BICUBIC
        values = values * np.float32(self.rescale)
        if self.normalize:
            values = ((values - np.array(self.mean, np.float32))
                      / np.array(self.std, np.float32))
        return np.ascontiguousarray(values.transpose(2, 0, 1))[None]


def build_gemma4(config: Mapping[str, Any], tokenizer: Any,
                 processor: Mapping[str, Any]) -> VisionFormat:
    """Gemma 4's format from its processor settings (mlx-vlm's defaults where unset) and its
    tokenizer's image tokens."""
    marks = (int(config.get("image_token_id", token_id(tokenizer, "<|image|>"))),
             int(config.get("boi_token_id", token_id(tokenizer, "<|image>"))),
             int(config.get("eoi_token_id", token_id(tokenizer, "<image|>"))))
    return Gemma4Format(
        str(config.get("model_type")), *marks, int(processor.get("patch_size", 16)),
        int(processor.get("pooling_kernel_size", 3)),
        int(processor.get("max_soft_tokens", 280)), bool(processor.get("do_resize", True)),
        float(processor.get("rescale_factor", 1 / 255)) if processor.get("do_rescale", True)
        else 1.0, bool(processor.get("do_normalize", False)),
        tuple(float(v) for v in processor.get("image_mean") or (0.5,) * 3),
        tuple(float(v) for v in processor.get("image_std") or (0.5,) * 3),
        spelling_of(tokenizer, marks))
