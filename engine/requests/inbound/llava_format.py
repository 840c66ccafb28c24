"""LLaVA 1.5's image format: a CLIP view of the image, one ``<image>`` token a patch.

Its processor (transformers' ``CLIPImageProcessor``, which mlx-vlm's ``LlavaProcessor``
wraps) resizes the image's shortest edge to ``size.shortest_edge`` (the other edge kept in
ratio, truncated), crops the centre to ``crop_size`` (padding with black where the image is
smaller), then rescales and normalises; the prompt's ``<image>`` becomes one ``<image>``
per patch of the crop, plus ``num_additional_image_tokens`` (CLIP's class token), less one
where the ``vision_feature_select_strategy`` is ``"default"`` (the class token dropped).
No begin or end tokens. No mlx here (numpy and Pillow).
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
    mean_std,
    normalised,
    spelling_of,
)

# A resized image past this many pixels is refused (the request's own bound on images).
_MAX_RESIZED_PIXELS = 40_000_000
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class LlavaFormat(VisionFormat):
    """LLaVA 1.5: shortest edge resized, the centre cropped, a token a patch."""

    family: str
    image_token: int
    shortest_edge: int | None  # None: resized to ``resize`` exactly
    resize: tuple[int, int] | None  # (height, width), where no shortest edge is given
    crop: tuple[int, int] | None  # (height, width); None: no centre crop
    patch: int
    extra_tokens: int  # tokens beyond the patches: the class token, less a dropped one
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    resample: int = 3  # BICUBIC
    spelling: tuple[tuple[int, str], ...] = ()

    def _resized_size(self, image: DecodedImage) -> tuple[int, int]:
        """(height, width) after the resize, as transformers' ``get_resize_output_image_size``
        (the long edge truncated)."""
        width, height = image.size
        if self.shortest_edge is None:
            return self.resize if self.resize is not None else (height, width)
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        size = (new_long, new_short) if width <= height else (new_short, new_long)
        if size[0] * size[1] > _MAX_RESIZED_PIXELS:
            raise InvalidRequestError(
                f"{image.at}: an image of {width}x{height} px is too long and thin for this "
                f"model: its processor resizes the short side to {self.shortest_edge} px, "
                f"{size[1]}x{size[0]} px in all; crop it or pad it nearer a square",
                image.at)
        return size

    def _view(self, image: DecodedImage) -> tuple[int, int]:
        """(height, width) of the view the tower reads."""
        return self.crop if self.crop is not None else self._resized_size(image)

    def read(self, image: DecodedImage) -> ImageTokens:
        height, width = self._view(image)
        self._resized_size(image)  # refuses what the processor cannot resize here
        count = (height // self.patch) * (width // self.patch) + self.extra_tokens
        return ImageTokens((self.image_token,) * count)

    def pixels(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image

        height, width = self._resized_size(image)
        values = image.pixels
        if (width, height) != image.size:
            values = np.asarray(Image.fromarray(values).resize((width, height),
                                                               self.resample))
        if self.crop is not None:
            values = _centre_crop(values, *self.crop)
        return normalised(values, self.mean, self.std, self.rescale)[None]


def _centre_crop(values: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop``: the centre ``height`` x ``width``, an image smaller
    than that padded with zeros around it first."""
    rows, columns = values.shape[:2]
    top, left = (rows - height) // 2, (columns - width) // 2
    if top >= 0 and left >= 0 and top + height <= rows and left + width <= columns:
        return values[top:top + height, left:left + width]
    padded_rows, padded_columns = max(height, rows), max(width, columns)
    padded = np.zeros((padded_rows, padded_columns, *values.shape[2:]), values.dtype)
    top_pad = math.ceil((padded_rows - rows) / 2)
    left_pad = math.ceil((padded_columns - columns) / 2)
    padded[top_pad:top_pad + rows, left_pad:left_pad + columns] = values
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(padded_rows, top + height),
                  max(0, left):min(padded_columns, left + width)]


def _pair(size: Any) -> tuple[int, int] | None:
    """A size setting's (height, width), where it gives both (an int: a square)."""
    if isinstance(size, int):
        return size, size
    if isinstance(size, Mapping) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    return None


def build_llava(config: Mapping[str, Any], tokenizer: Any,
                processor: Mapping[str, Any]) -> VisionFormat:
    """LLaVA's format from its ``config.json`` and processor settings (mlx-vlm's
    ``LlavaProcessor`` reads ``patch_size``, ``num_additional_image_tokens`` and
    ``vision_feature_select_strategy`` from ``processor_config.json``)."""
    vision = config["vision_config"]
    image_token = int(config.get("image_token_index", config.get("image_token_id", 32000)))
    size = processor.get("size", {"shortest_edge": int(vision.get("image_size", 336))})
    shortest = (int(size["shortest_edge"]) if isinstance(size, Mapping)
                and "shortest_edge" in size else None)
    resize = _pair(size) if shortest is None else None
    if not processor.get("do_resize", True):
        shortest, resize = None, None
    crop = _pair(processor.get("crop_size")) if processor.get("do_center_crop", True) else None
    strategy = processor.get("vision_feature_select_strategy",
                             config.get("vision_feature_select_strategy", "default"))
    extra = int(processor.get("num_additional_image_tokens", 1)) - (strategy == "default")
    mean, std = mean_std({"image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, **processor},
                          0.5, 0.5)
    resample = processor.get("resample")
    return LlavaFormat(
        str(config.get("model_type")), image_token, shortest, resize, crop,
        int(processor.get("patch_size", vision.get("patch_size", 14))), extra, mean, std,
        float(processor.get("rescale_factor", 1 / 255)),
        int(resample) if isinstance(resample, int) else 3,
        spelling_of(tokenizer, (image_token,)))
