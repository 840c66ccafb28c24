"""InternVL's image format: square tiles on the grid nearest the image's aspect ratio, and a
thumbnail.

As mlx-vlm's ``InternVLChatProcessor`` does it (InternVL's own ``dynamic_preprocess``): of
the grids of ``min_dynamic_patch`` to ``max_dynamic_patch`` tiles, the one whose aspect
ratio is nearest the image's (a tie to the grid whose area is nearer the image's), the image
resized to it (bicubic) and cut into ``force_image_size`` px tiles row by row, then, where
there are several tiles and ``use_thumbnail``, the whole image resized to one more tile.
Each tile is ``num_image_token`` ``<IMG_CONTEXT>`` tokens (its patches pixel-shuffled by
``downsample_ratio``), the image's block ``<img>``, their tokens, ``</img>``. The pixels are
the tiles, stacked (1, tiles, 3, side, side), normalised by ImageNet's statistics. No mlx
here (numpy and Pillow).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.requests.inbound.images import DecodedImage
from engine.requests.inbound.vision_formats import (
    ImageTokens,
    VisionFormat,
    normalised,
    spelling_of,
    token_id,
)

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def nearest_grid(width: int, height: int, side: int, min_tiles: int,
                 max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile grid nearest the image's aspect ratio; a tie goes to the
    grid whose area in pixels is nearer the image's (mlx-vlm's ``find_closest_aspect_ratio``)."""
    ratios = sorted({(i, j) for n in range(min_tiles, max_tiles + 1)
                     for i in range(1, n + 1) for j in range(1, n + 1)
                     if min_tiles <= i * j <= max_tiles}, key=lambda r: r[0] * r[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and (abs(area - side * side * ratio[0] * ratio[1])
                                    < abs(area - side * side * best[0] * best[1])):
            best = ratio
    return best


@dataclass(frozen=True)
class InternVLFormat(VisionFormat):
    """InternVL: tiles of a grid near the image's aspect ratio, and a thumbnail."""

    family: str
    image_token: int
    start_token: int
    end_token: int
    tokens_per_tile: int
    side: int
    min_tiles: int
    max_tiles: int
    thumbnail: bool
    mean: tuple[float, ...] = _IMAGENET_MEAN
    std: tuple[float, ...] = _IMAGENET_STD
    rescale: float = 1 / 255
    spelling: tuple[tuple[int, str], ...] = ()

    def _tiles(self, image: DecodedImage) -> tuple[int, int, bool]:
        """(columns, rows, thumbnail): the grid and whether a thumbnail follows it."""
        columns, rows = nearest_grid(*image.size, self.side, self.min_tiles, self.max_tiles)
        return columns, rows, self.thumbnail and columns * rows > 1

    def read(self, image: DecodedImage) -> ImageTokens:
        columns, rows, thumbnail = self._tiles(image)
        count = (columns * rows + thumbnail) * self.tokens_per_tile
        return ImageTokens((self.start_token, *([self.image_token] * count), self.end_token),
                           {"image_token_index": self.image_token})

    def pixels(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image

        columns, rows, thumbnail = self._tiles(image)
        side = self.side
        picture = Image.fromarray(image.pixels)
        grid = picture.resize((side * columns, side * rows), Image.Resampling.BICUBIC)
        tiles = [np.asarray(grid.crop((c * side, r * side, (c + 1) * side, (r + 1) * side)))
                 for r in range(rows) for c in range(columns)]
        if thumbnail:
            tiles.append(np.asarray(picture.resize((side, side), Image.Resampling.BICUBIC)))
        return np.stack([normalised(t, self.mean, self.std, self.rescale)
                         for t in tiles])[None]


def build_internvl(config: Mapping[str, Any], tokenizer: Any,
                   processor: Mapping[str, Any]) -> VisionFormat:
    """InternVL's format from its ``config.json`` (where mlx-vlm's processor reads the
    tiling) and ``processor_config.json`` (which overrides the tile's size and tokens)."""
    vision = config.get("vision_config", {})
    side = int(processor.get("image_size", config.get("force_image_size",
                                                      vision.get("image_size", 448))))
    patch = int(processor.get("patch_size", vision.get("patch_size", 14)))
    ratio = float(processor.get("downsample_ratio", config.get("downsample_ratio", 0.5)))
    tokens = int(processor.get("num_image_token", int((side // patch) ** 2 * ratio ** 2)))
    marks = (token_id(tokenizer, "<IMG_CONTEXT>"), token_id(tokenizer, "<img>"),
             token_id(tokenizer, "</img>"))
    return InternVLFormat(
        str(config.get("model_type")), *marks, tokens, side,
        int(config.get("min_dynamic_patch", 1)), int(config.get("max_dynamic_patch", 12)),
        bool(config.get("use_thumbnail", True)), spelling=spelling_of(tokenizer, marks))
