"""Llama 4's image format: square tiles on the best-fitting grid of a few, and a global view.

As mlx-vlm's ``Llama4ImageProcessor`` does it: of the grids (rows, columns) (1, 1), (1, 2),
(1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1) with at most ``max_patches`` tiles, the one
whose ``size`` px tiles fit the image scaled to them best (the least slack on both edges,
the first on a tie); the image is resized to the grid (bicubic, its ratio not kept) and cut
into tiles row by row, each rescaled (divided by 255) and normalised. Each tile is
``(size / patch_size)^2 * pixel_shuffle_ratio^2`` ``<|patch|>`` tokens (the tower's
patches, pixel-shuffled); the block is ``<|image_start|>``, where there are several tiles
each tile's tokens with ``<|tile_x_separator|>`` between the tiles of a row and
``<|tile_y_separator|>`` after each row, then ``<|image|>`` and the global view's tokens,
``<|image_end|>``, as its ``Llama4Processor`` writes it.

The global view: an image of one tile is its own global view (the tile is the whole image
resized to one tile, the processor's pixels exactly). Where there are several, the
processor writes the global view's tokens but gives no pixels for it (transformers'
processor appends the whole image resized to one tile; mlx-vlm's omits it, so its model
reads past its features there): its pixels here are the whole image resized to one tile
(bicubic), what the processor gives for an image of one tile, after the tiles. No mlx here
(numpy and Pillow).
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
    spelling_of,
    token_id,
)

# mlx-vlm's Llama4ImageProcessor's grids, (rows, columns), in its order.
GRIDS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


def best_grid(width: int, height: int, side: int, max_tiles: int) -> tuple[int, int]:
    """(rows, columns) of the grid whose tiles fit the image best (mlx-vlm's
    ``_get_best_resolution``, exactly)."""
    best, best_fit = (1, 1), float("inf")
    for rows, columns in GRIDS:
        if rows * columns > max_tiles:
            continue
        scale = min(columns * side / width, rows * side / height)
        fit = abs(width * scale - columns * side) + abs(height * scale - rows * side)
        if fit < best_fit:
            best_fit, best = fit, (rows, columns)
    return best


@dataclass(frozen=True)
class Llama4Format(VisionFormat):
    """Llama 4: tiles of a grid near the image's shape, then its global view."""

    family: str
    image_token: int  # <|patch|>
    start_token: int  # <|image_start|>
    end_token: int  # <|image_end|>
    global_token: int  # <|image|>
    column_token: int  # <|tile_x_separator|>
    row_token: int  # <|tile_y_separator|>
    side: int
    max_tiles: int
    tokens_per_tile: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    spelling: tuple[tuple[int, str], ...] = ()

    def read(self, image: DecodedImage) -> ImageTokens:
        rows, columns = best_grid(*image.size, self.side, self.max_tiles)
        tile = [self.image_token] * self.tokens_per_tile
        ids = [self.start_token]
        if rows * columns > 1:
            for _ in range(rows):
                for column in range(columns):
                    ids += tile
                    if column < columns - 1:
                        ids.append(self.column_token)
                ids.append(self.row_token)
        ids += [self.global_token, *tile, self.end_token]
        return ImageTokens(tuple(ids))

    def pixels(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image

        rows, columns = best_grid(*image.size, self.side, self.max_tiles)
        side = self.side
        picture = Image.fromarray(image.pixels)
        views = [picture.resize((side, side), Image.Resampling.BICUBIC)]  # the global view
        if rows * columns > 1:
            grid = picture.resize((columns * side, rows * side), Image.Resampling.BICUBIC)
            views = [grid.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
                     for r in range(rows) for c in range(columns)] + views
        return np.stack([self._normalised(np.asarray(view)) for view in views])

    def _normalised(self, view: np.ndarray) -> np.ndarray:
        """A tile as the processor's ``_preprocess_single``: divided by 255, normalised,
        channel-first."""
        values = view.astype(np.float32) / np.float32(255.0)
        values = (values - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(values.transpose(2, 0, 1))


def build_llama4(config: Mapping[str, Any], tokenizer: Any,
                 processor: Mapping[str, Any]) -> VisionFormat:
    """Llama 4's format: the tile's size, the grid's bound and the statistics from
    ``preprocessor_config.json`` (as mlx-vlm's processor reads them), the tokens a tile from
    the tower's ``vision_config`` (its patch and pixel shuffle)."""
    vision = config.get("vision_config", {})
    size = processor.get("size", 336)
    side = int(size.get("height", 336) if isinstance(size, Mapping) else size)
    patch = int(vision.get("patch_size", 14))
    ratio = float(vision.get("pixel_shuffle_ratio", 0.5))
    tokens = (side // patch) ** 2 // round(1.0 / ratio ** 2)
    image = int(config.get("image_token_index", token_id(tokenizer, "<|patch|>")))
    marks = (image, token_id(tokenizer, "<|image_start|>"), token_id(tokenizer, "<|image_end|>"),
             token_id(tokenizer, "<|image|>"), token_id(tokenizer, "<|tile_x_separator|>"),
             token_id(tokenizer, "<|tile_y_separator|>"))
    return Llama4Format(
        str(config.get("model_type")), *marks, side, int(processor.get("max_patches", 16)),
        tokens, tuple(float(v) for v in processor.get("image_mean", (0.5,) * 3)),
        tuple(float(v) for v in processor.get("image_std", (0.5,) * 3)),
        spelling_of(tokenizer, marks))
