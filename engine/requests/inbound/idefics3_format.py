"""SmolVLM / Idefics3's image format: square views of a resized image, and a global view.

As their processors (transformers' ``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``,
which mlx-vlm's processors wrap) do it: the image's longest edge is resized to
``size.longest_edge`` (the other kept in ratio, rounded up to even), then both edges up to
multiples of the view side (``max_image_size.longest_edge``); an image larger than one view
is cut into a grid of views, row by row, and the whole of it resized to one more view (the
global view). Each view is ``image_seq_len`` ``<image>`` tokens (the tower's patches,
pixel-shuffled): a grid's views each after ``<fake_token_around_image><row_r_col_c>``, a
newline after each row of the grid, a blank line, then the global view between
``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``; an image of
one view is the global view's block alone. The pixels are the views, stacked
(1, views, 3, side, side). No mlx here (numpy and Pillow).
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
    UnsupportedVision,
    VisionFormat,
    mean_std,
    normalised,
    resized,
    spelling_of,
    token_id,
)

MAX_IMAGE_SIZE = 4096  # the processors' absolute bound on a resized edge
_GRID_TOKENS = 8  # <row_r_col_c> tokens looked up to this many rows and columns


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge resized to ``longest``, the other kept in
    ratio (truncated, then rounded up to even), within ``MAX_IMAGE_SIZE``: the processors'
    ``get_resize_output_image_size``."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def view_multiple_size(height: int, width: int, side: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of ``side``, the longer edge first:
    the processors' ``resize_for_vision_encoder``."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return height, width


@dataclass(frozen=True)
class Idefics3Format(VisionFormat):
    """SmolVLM / Idefics3: a grid of square views and a global view."""

    family: str
    image_token: int
    fake_token: int
    global_token: int
    tile_tokens: Mapping[tuple[int, int], int]  # (row, column) -> <row_r_col_c>
    row_end: tuple[int, ...]  # a newline, after each row of the grid but the last
    grid_end: tuple[int, ...]  # the last row's newline and the blank line before the global
    tokens_per_view: int
    longest_edge: int | None  # None: no resize before the views
    view: int
    split: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    resample: int = 1  # LANCZOS
    spelling: tuple[tuple[int, str], ...] = ()

    def _sizes(self, image: DecodedImage) -> tuple[tuple[int, int], tuple[int, int]]:
        """(height, width) after the first resize, and after rounding to views."""
        width, height = image.size
        if self.longest_edge is not None:
            height, width = longest_edge_size(height, width, self.longest_edge)
        if not self.split:
            return (height, width), (self.view, self.view)
        return (height, width), view_multiple_size(height, width, self.view)

    def _grid(self, image: DecodedImage) -> tuple[int, int]:
        """(rows, columns) of views; (0, 0): the image is one view."""
        _, (height, width) = self._sizes(image)
        if not self.split or (height <= self.view and width <= self.view):
            return 0, 0
        return (height - self.view) // self.view + 1, (width - self.view) // self.view + 1

    def read(self, image: DecodedImage) -> ImageTokens:
        rows, columns = self._grid(image)
        views = [self.image_token] * self.tokens_per_view
        ids: list[int] = []
        for row in range(1, rows + 1):
            for column in range(1, columns + 1):
                marker = self.tile_tokens.get((row, column))
                if marker is None:
                    raise InvalidRequestError(
                        f"{image.at}: an image of {image.size[0]}x{image.size[1]} px takes "
                        f"a {rows}x{columns} grid of views, and the tokenizer has no "
                        f"<row_{row}_col_{column}> token", image.at)
                ids += [self.fake_token, marker, *views]
            ids += self.grid_end if row == rows else self.row_end
        ids += [self.fake_token, self.global_token, *views, self.fake_token]
        return ImageTokens(tuple(ids))

    def pixels(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image

        (height, width), (views_h, views_w) = self._sizes(image)
        first = resized(image, width, height, self.resample)
        values = (first if (views_w, views_h) == (width, height) else
                  np.asarray(Image.fromarray(first).resize((views_w, views_h), self.resample)))
        rows, columns = self._grid(image)
        side = self.view
        frames = [values[r * side:(r + 1) * side, c * side:(c + 1) * side]
                  for r in range(rows) for c in range(columns)]
        if rows or columns:  # the global view, from the image rounded to views
            frames.append(np.asarray(Image.fromarray(values).resize((side, side),
                                                                    self.resample)))
        else:
            frames.append(values)
        return np.stack([normalised(f, self.mean, self.std, self.rescale)
                         for f in frames])[None]


def build_idefics3(config: Mapping[str, Any], tokenizer: Any,
                   processor: Mapping[str, Any]) -> VisionFormat:
    """SmolVLM's or Idefics3's format from its ``config.json`` and processor settings."""
    vision = config["vision_config"]
    image_token = int(config.get("image_token_id", config.get("image_token_index",
                                                                token_id(tokenizer, "<image>"))))
    fake = token_id(tokenizer, "<fake_token_around_image>")
    global_token = token_id(tokenizer, "<global-img>")
    tiles = {}
    for row in range(1, _GRID_TOKENS + 1):
        for column in range(1, _GRID_TOKENS + 1):
            try:
                tiles[(row, column)] = token_id(tokenizer, f"<row_{row}_col_{column}>")
            except UnsupportedVision:
                continue
    view_setting = processor.get("max_image_size", {"longest_edge": vision.get("image_size")})
    view = int(view_setting["longest_edge"])
    scale = int(config.get("scale_factor", 2))
    patch = int(vision.get("patch_size", 14))
    tokens = int(processor.get("image_seq_len", (view // patch) ** 2 // scale ** 2))
    size = processor.get("size", {"longest_edge": 4 * view})
    longest = (int(size["longest_edge"]) if processor.get("do_resize", True)
               and isinstance(size, Mapping) and "longest_edge" in size else None)
    if longest is None and processor.get("do_resize", True):
        raise UnsupportedVision("the image processor's size gives no longest_edge, which "
                                "SmolVLM / Idefics3's views are resized by")
    row_end = tuple(tokenizer.encode("\n", add_special_tokens=False))
    grid_end = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
    resample = processor.get("resample")
    mean, std = mean_std(processor, 0.5, 0.5)
    return Idefics3Format(
        str(config.get("model_type")), image_token, fake, global_token, tiles, row_end,
        grid_end, tokens, longest, view, bool(processor.get("do_image_splitting", True)),
        mean, std, float(processor.get("rescale_factor", 1 / 255)),
        int(resample) if isinstance(resample, int) else 1,
        spelling_of(tokenizer, (image_token, fake, global_token, *tiles.values(), *row_end,
                              *grid_end)))
