"""How a vision-language model family reads an image: the tokens it takes, the pixels it wants.

A ``VisionFormat`` is everything the prompt side needs, read from the checkpoint's
``config.json`` (and ``preprocessor_config.json`` where present) and its tokenizer: for
each image, the token block it occupies in the prompt (where its image tokens are, the
vision features go) and the pixel values the tower reads, with whatever else the tower
needs (``extra``: an image's size, a patch grid). The tower itself runs in
``engine.device.vision.tower``. No mlx here (numpy and Pillow).

Families (``FORMATS``):

- Gemma 3: SigLIP at a fixed square size; ``mm_tokens_per_image`` soft tokens between
  ``<start_of_image>`` and ``<end_of_image>``, set off by blank lines, as its processor
  writes them.
- Mistral 3 (Pixtral's tower): any aspect ratio, the longest edge at most the processor's
  size, in patches of ``patch_size * spatial_merge_size``; one ``[IMG]`` per merged patch,
  row by row, rows separated by ``[IMG_BREAK]``, the last closed by ``[IMG_END]``.
- Qwen2-VL / Qwen2.5-VL: "smart resize" to multiples of 28 px within a pixel budget,
  14 px patches flattened with their temporal copy, one ``<|image_pad|>`` per 2x2 merged
  patch between ``<|vision_start|>`` and ``<|vision_end|>``. Its text model places an
  image's tokens on a grid (M-RoPE): ``ImageTokens.grid``.
- LFM2-VL: SigLIP2 patches of 16 px packed into rows, halved each way by pixel-unshuffle;
  an image within the token budget is one view, a larger one 512 px tiles (each marked
  ``<|img_row_r_col_c|>``) and a thumbnail, between ``<|image_start|>`` and
  ``<|image_end|>``, as the official processor (and mlx-vlm's) lays them out.

Other vision checkpoints are loaded for text, and their images are refused with
``UnsupportedVision`` naming the family.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError, UnsupportedMediaError
from engine.requests.inbound.audio import DecodedAudio
from engine.requests.inbound.images import DecodedImage
from engine.requests.inbound.videos import DecodedVideo, sample_indices
from engine.requests.inbound.vision_families import images_refused_because


@dataclass(frozen=True)
class ImageTokens:
    """One image as the prompt holds it: its tokens and the tower's inputs besides its
    pixel values (all of which follow from its size alone)."""

    ids: tuple[int, ...]  # the block it occupies in the prompt
    extra: Mapping[str, Any] = field(default_factory=dict)  # the tower's other inputs
    # M-RoPE families: the (rows, columns) grid its image tokens take in position space.
    grid: tuple[int, int] | None = None
    # A video's block: its media token (the family's video token), the temporal groups
    # its tokens take on the grid, and text written before it (Qwen3-VL's timestamps).
    token: int | None = None
    frames: int = 1
    prefix: str = ""


class VisionFormat(ABC):
    """One family's image tokens and preprocessing (each a frozen dataclass)."""

    family: str
    image_token: int  # the token whose embeddings the vision features replace
    # How each token of the family's blocks is written in the prompt's text (an added
    # token as itself, Gemma 3's blank lines as newlines): ``text``.
    spelling: tuple[tuple[int, str], ...]

    @property
    def key(self) -> str:
        """The format's every setting, as a feature-cache key's part: same key, same pixel
        values and tokens."""
        return ":".join(f"{f.name}={getattr(self, f.name)}"
                        for f in fields(self))  # type: ignore[arg-type]

    @abstractmethod
    def read(self, image: DecodedImage) -> ImageTokens:
        """The image's tokens (from its size: its pixels are not read)."""

    def text(self, tokens: ImageTokens) -> str:
        """The image's block as the family's processor writes it into the prompt's text,
        which is then encoded whole: text around the block merges with it as there."""
        spelled = dict(self.spelling)
        return tokens.prefix + "".join(spelled[t] for t in tokens.ids)

    def read_video(self, video: DecodedVideo) -> list[ImageTokens]:
        """A video's blocks (one, or one per temporal group), in order; a family that reads
        no video refuses it here."""
        raise UnsupportedMediaError(
            f"{video.at}: this model's family ({self.family}) reads images, not videos: "
            "send frames as images", video.at, self.family,
            "the family's processor reads no video")

    def video_pixels(self, video: DecodedVideo, block: int) -> np.ndarray:
        """The tower's pixel values for a video's ``block`` (``read_video``'s order)."""
        raise NotImplementedError(self.family)

    def read_audio(self, audio: DecodedAudio) -> list[ImageTokens]:
        """An audio clip's block (its ``token`` the family's audio token); a family, or a
        checkpoint, that reads no audio refuses it here."""
        raise UnsupportedMediaError(
            f"{audio.at}: this model's family ({self.family}) reads no audio", audio.at,
            self.family, "the family's audio is not read by this engine")

    def audio_features(self, audio: DecodedAudio) -> np.ndarray:
        """What the audio side reads for a clip (``read_audio``'s block): Gemma 4's is the
        waveform, which the device side turns into its feature extractor's frames."""
        raise NotImplementedError(self.family)

    @abstractmethod
    def pixels(self, image: DecodedImage) -> np.ndarray:
        """The tower's pixel values for the image, as it takes one image (float32); read
        only when the tower runs (a cached image's never are)."""


def _normalised(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...],
                rescale: float) -> np.ndarray:
    """uint8 (height, width, 3) -> float32 (3, height, width), rescaled and normalised."""
    values = image.astype(np.float32) * np.float32(rescale)
    values = (values - np.array(mean, np.float32)) / np.array(std, np.float32)
    return np.ascontiguousarray(values.transpose(2, 0, 1))


def _resized(image: DecodedImage, width: int, height: int, resample: int) -> np.ndarray:
    from PIL import Image

    if image.size == (width, height):
        return image.pixels
    return np.asarray(Image.fromarray(image.pixels).resize((width, height), resample))


@dataclass(frozen=True)
class Gemma3Format(VisionFormat):
    """Gemma 3: a fixed square, a fixed number of soft tokens."""

    family: str
    image_token: int
    block_ids: tuple[int, ...]
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    spelling: tuple[tuple[int, str], ...] = ()

    def read(self, image: DecodedImage) -> ImageTokens:
        return ImageTokens(self.block_ids)

    def pixels(self, image: DecodedImage) -> np.ndarray:
        side = self.image_size
        resized = _resized(image, side, side, 2)  # PIL's BILINEAR, as Gemma 3's processor
        return _normalised(resized, self.mean, self.std, self.rescale)[None]


@dataclass(frozen=True)
class Mistral3Format(VisionFormat):
    """Mistral 3 / Pixtral: the image's own aspect ratio, rows of merged patches."""

    family: str
    image_token: int
    break_token: int
    end_token: int
    longest_edge: int
    patch: int  # the tower's patch times the spatial merge: one token's square of pixels
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    spelling: tuple[tuple[int, str], ...] = ()

    def _grid(self, image: DecodedImage) -> tuple[int, int]:
        """(rows, columns) of tokens: the longest edge within bounds, sides rounded up."""
        width, height = image.size
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            # A side that floors to nothing keeps one pixel, so one row of tokens: the
            # processors' own formula gives no rows there, an image they cannot read.
            height = max(1, math.floor(height / ratio))
            width = max(1, math.floor(width / ratio))
        return (height - 1) // self.patch + 1, (width - 1) // self.patch + 1

    def read(self, image: DecodedImage) -> ImageTokens:
        rows, columns = self._grid(image)
        ids: list[int] = []
        for row in range(rows):
            ids += [self.image_token] * columns
            ids.append(self.break_token if row < rows - 1 else self.end_token)
        return ImageTokens(tuple(ids),
                           {"image_sizes": [(rows * self.patch, columns * self.patch)]})

    def pixels(self, image: DecodedImage) -> np.ndarray:
        rows, columns = self._grid(image)
        resized = _resized(image, columns * self.patch, rows * self.patch, 3)  # BICUBIC
        return _normalised(resized, self.mean, self.std, self.rescale)[None]


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's size rule: each side a multiple of ``factor``, the area within bounds
    (its processor's, exactly: a side that rounds to nothing is scaled up to the least)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} px is too long and thin for this "
                         "model: its processor reads aspect ratios under 200 only; crop it "
                         "or pad it nearer a square")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLFormat(VisionFormat):
    """Qwen2-VL: flattened patches on a grid, one pad token per merged patch."""

    family: str
    image_token: int
    start_token: int
    end_token: int
    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    spelling: tuple[tuple[int, str], ...] = ()
    # Videos: the video token, frames a second and their bounds, the frame size's pixel
    # bounds (Qwen2-VL: per frame; Qwen3-VL: over the whole clip), and whether each
    # temporal group is a block of its own after its ``<t seconds>`` (Qwen3-VL, Qwen3.5).
    video_token: int | None = None
    video_rate: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    timestamps: bool = False

    def _size(self, image: DecodedImage) -> tuple[int, int]:
        width, height = image.size
        try:
            return smart_resize(height, width, self.patch * self.merge, self.min_pixels,
                                self.max_pixels)
        except ValueError as exc:
            raise InvalidRequestError(f"{image.at}: {exc}", image.at) from exc

    def read(self, image: DecodedImage) -> ImageTokens:
        height, width = self._size(image)
        rows, columns = height // self.patch, width // self.patch
        count = rows * columns // (self.merge * self.merge)
        return ImageTokens((self.start_token, *([self.image_token] * count), self.end_token),
                           {"image_grid_thw": [[1, rows, columns]]},
                           (rows // self.merge, columns // self.merge))

    def pixels(self, image: DecodedImage) -> np.ndarray:
        height, width = self._size(image)
        values = _normalised(_resized(image, width, height, 3), self.mean, self.std,
                             self.rescale)  # BICUBIC, as its processor
        return self._patches(np.repeat(values[None], self.temporal, axis=0))  # a still, twice

    def _patches(self, frames: np.ndarray) -> np.ndarray:
        """(frames, channels, height, width) -> the tower's flattened patches, temporal
        groups of ``temporal`` frames first, then merged squares row by row."""
        groups, channels, height, width = frames.shape
        groups //= self.temporal
        rows, columns = height // self.patch, width // self.patch
        ps, ms = self.patch, self.merge
        patches = frames.reshape(1, groups, self.temporal, channels, rows // ms, ms, ps,
                                 columns // ms, ms, ps)
        patches = patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        return np.ascontiguousarray(patches.reshape(
            groups * rows * columns, channels * self.temporal * ps * ps))

    def _video_plan(self, video: DecodedVideo) -> tuple[list[int], int, int]:
        """(frame indices, height, width) the family reads a video at."""
        indices = sample_indices(video.frame_count, video.fps, rate=self.video_rate,
                                 factor=self.temporal, min_frames=self.min_frames,
                                 max_frames=self.max_frames)
        width, height = video.size
        factor = self.patch * self.merge
        try:
            if self.timestamps:  # Qwen3-VL: the pixel budget is the whole clip's
                frames = math.ceil(len(indices) / self.temporal) * self.temporal
                if height < factor or width < factor:
                    raise ValueError(f"a video of {width}x{height} px is smaller than "
                                     f"{factor} px, the least its processor reads")
                budget_h, budget_w = smart_resize(height, width, factor, 1, 1 << 62)
                if frames * budget_h * budget_w > self.video_max_pixels:
                    beta = math.sqrt(len(indices) * height * width / self.video_max_pixels)
                    budget_h = max(factor, math.floor(height / beta / factor) * factor)
                    budget_w = max(factor, math.floor(width / beta / factor) * factor)
                elif frames * budget_h * budget_w < self.video_min_pixels:
                    beta = math.sqrt(self.video_min_pixels / (len(indices) * height * width))
                    budget_h = math.ceil(height * beta / factor) * factor
                    budget_w = math.ceil(width * beta / factor) * factor
                return indices, budget_h, budget_w
            size = smart_resize(height, width, factor, self.video_min_pixels,
                                self.video_max_pixels)
        except ValueError as exc:
            raise InvalidRequestError(f"{video.at}: {exc}", video.at) from exc
        return indices, size[0], size[1]

    def read_video(self, video: DecodedVideo) -> list[ImageTokens]:
        if self.video_token is None:
            return super().read_video(video)
        indices, height, width = self._video_plan(video)
        rows, columns = height // self.patch, width // self.patch
        per_group = rows * columns // (self.merge * self.merge)
        groups = len(indices) // self.temporal
        grid = (rows // self.merge, columns // self.merge)
        if not self.timestamps:  # one block, its groups on the grid's time axis
            return [ImageTokens((self.start_token, *([self.video_token] * per_group * groups),
                                 self.end_token), {"video_grid_thw": [[groups, rows, columns]]},
                                grid, self.video_token, groups)]
        seconds = [i / video.fps for i in indices]
        return [ImageTokens((self.start_token, *([self.video_token] * per_group),
                             self.end_token), {"video_grid_thw": [[1, rows, columns]]}, grid,
                            self.video_token, 1,
                            f"<{(seconds[g * self.temporal] + seconds[g * self.temporal + self.temporal - 1]) / 2:.1f} seconds>")  # noqa: E501
                for g in range(groups)]

    def video_pixels(self, video: DecodedVideo, block: int) -> np.ndarray:
        from PIL import Image

        indices, height, width = self._video_plan(video)
        if self.timestamps:  # one temporal group a block
            indices = indices[block * self.temporal:(block + 1) * self.temporal]
        frames = video.frames(indices)
        resized = np.stack([np.asarray(Image.fromarray(f).resize((width, height), 3))
                            if f.shape[:2] != (height, width) else f for f in frames])
        values = np.stack([_normalised(f, self.mean, self.std, self.rescale) for f in resized])
        return self._patches(values)


@dataclass(frozen=True)
class Lfm2VlFormat(VisionFormat):
    """LFM2-VL: packed patch rows, one view or tiles and a thumbnail."""

    family: str
    image_token: int
    start_token: int
    end_token: int
    thumbnail_token: int
    tile_tokens: Mapping[tuple[int, int], int]  # (row, column) -> its marker token
    patch: int = 16
    downsample: int = 2
    min_tokens: int = 64
    max_tokens: int = 256
    tile_size: int = 512
    tolerance: float = 2.0
    min_tiles: int = 2
    max_tiles: int = 10
    thumbnail: bool = True
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 3  # BICUBIC
    spelling: tuple[tuple[int, str], ...] = ()

    @property
    def max_patches(self) -> int:
        return max(self.max_tokens * self.downsample ** 2, (self.tile_size // self.patch) ** 2)

    def _tokens(self, rows: int, columns: int) -> int:
        """Image tokens of a view of rows x columns patches (odd sides padded, as the
        pixel-unshuffle does)."""
        f = self.downsample
        return ((rows + -rows % f) // f) * ((columns + -columns % f) // f)

    def _single(self, height: int, width: int) -> tuple[int, int]:
        factor = self.patch * self.downsample
        low = self.min_tokens * factor ** 2
        high = self.max_tokens * factor ** 2
        h_bar = max(factor, round(height / factor) * factor)
        w_bar = max(factor, round(width / factor) * factor)
        if h_bar * w_bar > high:
            beta = math.sqrt((height * width) / high)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < low:
            beta = math.sqrt(low / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def _too_large(self, height: int, width: int) -> bool:
        factor = self.patch * self.downsample
        h_bar = max(self.patch, round(height / factor) * factor)
        w_bar = max(self.patch, round(width / factor) * factor)
        return h_bar * w_bar > self.max_tokens * factor ** 2 * self.tolerance

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """(columns, rows) of tiles nearest the image's aspect ratio; ties go to the grid
        whose area the image fills more than half of."""
        ratios = sorted({(w, h) for n in range(self.min_tiles, self.max_tiles + 1)
                         for w in range(1, n + 1) for h in range(1, n + 1)
                         if self.min_tiles <= w * h <= self.max_tiles},
                        key=lambda r: r[0] * r[1])
        aspect, best, best_diff = width / height, (1, 1), float("inf")
        for ratio in ratios:
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best_diff, best = diff, ratio
            elif diff == best_diff and width * height > (
                    0.5 * self.tile_size * self.tile_size * ratio[0] * ratio[1]):
                best = ratio
        return best

    def _layout(self, image: DecodedImage) -> tuple[list[tuple[str, int, int, int, int]],
                                                     tuple[int, int]]:
        """The views of an image, each (kind, column, row, width, height): its tiles (kind
        "tile") and thumbnail, or the one whole view; and the tile grid (columns, rows)."""
        width, height = image.size
        single_h, single_w = self._single(height, width)
        if not self._too_large(height, width):
            return [("whole", 0, 0, single_w, single_h)], (1, 1)
        columns, rows = self._grid(height, width)
        side = self.tile_size
        views = [("tile", c, r, side, side) for r in range(rows) for c in range(columns)]
        if self.thumbnail and rows * columns > 1:
            views.append(("whole", 0, 0, single_w, single_h))
        return views, (columns, rows)

    def read(self, image: DecodedImage) -> ImageTokens:
        views, _ = self._layout(image)
        ids = [self.start_token]
        masks, shapes = [], []
        for kind, column, row, width, height in views:
            grid = (height // self.patch, width // self.patch)
            if grid[0] * grid[1] > self.max_patches:
                # A long thin image: its side is raised to the least while the other keeps
                # the ratio, past what the tower's padded view holds (the processor cuts
                # it short, and the tower then fails).
                raise InvalidRequestError(
                    f"{image.at}: an image of {image.size[0]}x{image.size[1]} px is too "
                    f"long and thin for this model: its view would take "
                    f"{grid[0] * grid[1]} patches, over the {self.max_patches} its tower "
                    "reads; crop it or pad it nearer a square", image.at)
            if kind == "tile":
                ids.append(self.tile_tokens[(row + 1, column + 1)])
            elif len(views) > 1:
                ids.append(self.thumbnail_token)
            ids += [self.image_token] * self._tokens(*grid)
            mask = np.zeros(self.max_patches, np.int32)
            mask[:min(grid[0] * grid[1], self.max_patches)] = 1
            masks.append(mask)
            shapes.append(grid)
        ids.append(self.end_token)
        return ImageTokens(tuple(ids), {"pixel_attention_mask": np.stack(masks),
                                        "spatial_shapes": np.array(shapes, np.int32)})

    def pixels(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image

        views, (columns, rows) = self._layout(image)
        big = None
        packed = []
        for kind, column, row, width, height in views:
            if kind == "tile":
                if big is None:
                    side = self.tile_size
                    big = Image.fromarray(image.pixels).resize(
                        (side * columns, side * rows), self.resample)
                view = np.asarray(big.crop((column * width, row * height,
                                            (column + 1) * width, (row + 1) * height)))
            else:
                view = _resized(image, width, height, self.resample)
            packed.append(self._packed(view))
        return np.stack(packed)

    def _packed(self, pixels: np.ndarray) -> np.ndarray:
        """A view's patch rows, packed and zero-padded to ``max_patches``."""
        values = _normalised(pixels, self.mean, self.std, self.rescale).transpose(1, 2, 0)
        height, width, channels = values.shape
        rows, columns, p = height // self.patch, width // self.patch, self.patch
        patches = values[:rows * p, :columns * p].reshape(rows, p, columns, p, channels)
        patches = patches.transpose(0, 2, 1, 3, 4).reshape(rows * columns, -1)
        packed = np.zeros((self.max_patches, patches.shape[1]), np.float32)
        packed[:len(patches)] = patches[:self.max_patches]
        return packed


class UnsupportedVision(Exception):
    """A vision checkpoint whose family's images this engine does not read (yet)."""


def is_vision_config(config: Mapping[str, Any]) -> bool:
    """The checkpoint has a vision tower (its images need a ``VisionFormat``)."""
    return isinstance(config.get("vision_config"), Mapping)


def _gemma3(config: Mapping[str, Any], tokenizer: Any,
            processor: Mapping[str, Any]) -> VisionFormat:
    vision = config["vision_config"]
    image_token = int(config.get("image_token_index", 262144))
    boi = int(config.get("boi_token_index", 255999))
    eoi = int(config.get("eoi_token_index", 256000))
    count = int(config.get("mm_tokens_per_image",
                           config.get("text_config", {}).get("mm_tokens_per_image", 256)))
    blank = list(tokenizer.encode("\n\n", add_special_tokens=False))
    block = (*blank, boi, *([image_token] * count), eoi, *blank)
    size = processor.get("size")
    side = int(size.get("height", vision.get("image_size", 896)) if isinstance(size, Mapping)
               else vision.get("image_size", 896))
    return Gemma3Format("gemma3", image_token, block, side, *_mean_std(processor, 0.5, 0.5),
                        float(processor.get("rescale_factor", 1 / 255)),
                        _spelling(tokenizer, block))


# CLIP's statistics: Pixtral's processor defaults.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _mistral3(config: Mapping[str, Any], tokenizer: Any,
              processor: Mapping[str, Any]) -> VisionFormat:
    vision = config["vision_config"]
    image_token = int(config.get("image_token_index", config.get("image_token_id", 10)))
    size = processor.get("size")
    edge = int(size.get("longest_edge", vision.get("image_size", 1024))
               if isinstance(size, Mapping) else vision.get("image_size", 1024))
    merge = int(config.get("spatial_merge_size", 2))
    patch = int(vision.get("patch_size", 14)) * merge
    mean = tuple(float(v) for v in processor.get("image_mean", _CLIP_MEAN))
    std = tuple(float(v) for v in processor.get("image_std", _CLIP_STD))
    breaks, end = _token_id(tokenizer, "[IMG_BREAK]"), _token_id(tokenizer, "[IMG_END]")
    return Mistral3Format("mistral3", image_token, breaks, end, edge, patch, mean, std,
                          float(processor.get("rescale_factor", 1 / 255)),
                          _spelling(tokenizer, (image_token, breaks, end)))


def _spelling(tokenizer: Any, ids: Iterable[int]) -> tuple[tuple[int, str], ...]:
    """Each token's text as a prompt writes it (an added token decodes to itself)."""
    return tuple((i, str(tokenizer.decode([i]))) for i in sorted(set(ids)))


def _token_id(tokenizer: Any, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == getattr(tokenizer, "unk_token_id", None):
        raise UnsupportedVision(f"the tokenizer has no {token} token, which the family's "
                                "image blocks need")
    return found


def _mean_std(processor: Mapping[str, Any], mean: float, std: float,
              ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return (tuple(float(v) for v in processor.get("image_mean", (mean,) * 3)),
            tuple(float(v) for v in processor.get("image_std", (std,) * 3)))


def _qwen2_vl(config: Mapping[str, Any], tokenizer: Any,
              processor: Mapping[str, Any]) -> VisionFormat:
    vision = config["vision_config"]
    patch = int(processor.get("patch_size", vision.get("patch_size", 14)))
    merge = int(processor.get("merge_size", vision.get("spatial_merge_size", 2)))
    mean = tuple(float(v) for v in processor.get("image_mean", _CLIP_MEAN))
    std = tuple(float(v) for v in processor.get("image_std", _CLIP_STD))
    image = int(config.get("image_token_id", _token_id(tokenizer, "<|image_pad|>")))
    start = int(config.get("vision_start_token_id", _token_id(tokenizer, "<|vision_start|>")))
    end = _token_id(tokenizer, "<|vision_end|>")
    video = config.get("video_token_id")
    video_settings = dict(processor.get("video", {}))
    timestamps = str(config.get("model_type")) in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                                   "qwen3_5_moe")
    video_size = video_settings.get("size")
    bounds: dict[str, Any] = {**{k: video_settings[k] for k in ("min_pixels", "max_pixels")
                                 if k in video_settings},
                              **(dict(video_size) if isinstance(video_size, Mapping) else {})}
    low = bounds.get("shortest_edge", bounds.get("min_pixels"))
    high = bounds.get("longest_edge", bounds.get("max_pixels"))
    return QwenVLFormat(
        str(config.get("model_type")), image, start, end, patch, merge,
        int(processor.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
        int(processor.get("min_pixels", 56 * 56)),
        int(processor.get("max_pixels", 28 * 28 * 1280)), mean, std,
        float(processor.get("rescale_factor", 1 / 255)),
        _spelling(tokenizer, (image, start, end, *(() if video is None else (int(video),)))),
        None if video is None else int(video),
        float(video_settings.get("fps", 2.0)), int(video_settings.get("min_frames", 4)),
        int(video_settings.get("max_frames", 768)),
        int(low) if low is not None else 4096 if timestamps else 128 * 28 * 28,
        int(high) if high is not None else 25165824 if timestamps else 768 * 28 * 28,
        timestamps)


def _qwen3_vl(config: Mapping[str, Any], tokenizer: Any,
              processor: Mapping[str, Any]) -> VisionFormat:
    """Qwen3-VL / Qwen3.5: Qwen2-VL's blocks and size rule on 16 px patches (a token per
    32 px square), the pixel budget in the processor's ``size`` (shortest_edge /
    longest_edge are areas there, as its processor reads them)."""
    size = processor.get("size")
    bounds = dict(size) if isinstance(size, Mapping) else {}
    settings = {"patch_size": 16, "image_mean": (0.5,) * 3, "image_std": (0.5,) * 3,
                "min_pixels": int(bounds.get("shortest_edge", 64 * 32 * 32)),
                "max_pixels": int(bounds.get("longest_edge", 16384 * 32 * 32)),
                **{k: v for k, v in processor.items() if k != "size"}}
    return _qwen2_vl(config, tokenizer, settings)


def _lfm2_vl(config: Mapping[str, Any], tokenizer: Any,
             processor: Mapping[str, Any]) -> VisionFormat:
    def setting(key: str, default: Any) -> Any:
        return processor.get(key, config.get(key, default))

    # The official processor's tiling, whatever a checkpoint's files say (mlx-vlm's too).
    min_tiles, max_tiles = 2, 10
    tile_tokens = {(r, c): _token_id(tokenizer, f"<|img_row_{r}_col_{c}|>")
                   for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1)
                   if r * c <= max_tiles}
    resample = processor.get("resample")
    mean, std = _mean_std(processor, 0.5, 0.5)
    image = int(config.get("image_token_index", config.get("image_token_id", 396)))
    marks = (_token_id(tokenizer, "<|image_start|>"), _token_id(tokenizer, "<|image_end|>"),
             _token_id(tokenizer, "<|img_thumbnail|>"))
    return Lfm2VlFormat(
        str(config.get("model_type")), image, *marks, tile_tokens,
        int(setting("encoder_patch_size", 16)), int(setting("downsample_factor", 2)),
        int(setting("min_image_tokens", 64)), int(setting("max_image_tokens", 256)),
        int(setting("tile_size", 512)), float(setting("max_pixels_tolerance", 2.0)),
        min_tiles, max_tiles, True, mean, std,
        float(processor.get("rescale_factor", 1 / 255)),
        int(resample) if isinstance(resample, int) else 3,
        _spelling(tokenizer, (image, *marks, *tile_tokens.values())))


# What the families written in modules of their own (``family_formats``) build on.
normalised, resized, spelling_of, token_id, mean_std = (_normalised, _resized, _spelling,
                                                        _token_id, _mean_std)


def _apart(config: Mapping[str, Any], tokenizer: Any,
           processor: Mapping[str, Any]) -> VisionFormat:
    """A family whose format is written in a module of its own (``family_formats``)."""
    from engine.requests.inbound.family_formats import BUILDERS

    return BUILDERS[str(config.get("model_type"))](config, tokenizer, processor)


FORMATS: dict[str, Callable[[Mapping[str, Any], Any, Mapping[str, Any]], VisionFormat]] = {
    "gemma3": _gemma3, "mistral3": _mistral3, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_vl,
    "lfm2-vl": _lfm2_vl, "lfm2_vl": _lfm2_vl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl,
    "qwen3_5": _qwen3_vl, "qwen3_5_moe": _qwen3_vl,
    **dict.fromkeys(("llava", "smolvlm", "idefics3", "internvl_chat", "gemma4",
                      "llama4"), _apart)}
# Families whose text model places image tokens on a grid of positions (M-RoPE; Qwen3's
# interleaves its sections, which the vision library's language model applies).
GRID_POSITIONS = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                            "qwen3_5_moe"})
# Families whose image rows are prefilled through the vision library's language model, the
# text model's weights shared: the grid's (M-RoPE), Gemma 4's (per-layer inputs, an
# image's tokens attending both ways) and Llama 4's (mlx-lm's takes no embeddings).
LIBRARY_PREFILL = GRID_POSITIONS | {"gemma4", "llama4"}
SUPPORTED = tuple(FORMATS)
# Families whose videos are read (QwenVLFormat.read_video).
VIDEO_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                            "qwen3_5_moe"})
# Families whose audio is read where the checkpoint has an audio tower (``audio_config``):
# Gemma4Format.read_audio.
AUDIO_FAMILIES = frozenset({"gemma4"})


def vision_format(config: Mapping[str, Any], tokenizer: Any,
                  model_path: Path | None = None) -> VisionFormat | None:
    """The checkpoint's format; None for a text-only model. Raises ``UnsupportedVision``
    for a vision checkpoint of a family not in ``FORMATS``."""
    if not is_vision_config(config):
        return None
    family = str(config.get("model_type"))
    build = FORMATS.get(family)
    if build is None:
        raise UnsupportedVision(f"the model's family {family!r} has a vision tower, but "
                                f"its images are not read: {images_refused_because(family)}")
    return build(config, tokenizer, _preprocessor(model_path))


def _preprocessor(model_path: Path | None) -> dict[str, Any]:
    """The image processor's settings: ``preprocessor_config.json`` (or its nested
    ``image_processor``), then ``processor_config.json``'s, which win (LFM2-VL's split);
    the video processor's (``video_preprocessor_config.json``) under ``video``; the audio
    settings of the processor's own file (``processor_config.json`` where there is one, as
    mlx-vlm's Gemma 4 processor reads it: ``audio_seq_length``, ``audio_ms_per_token``,
    ``feature_extractor``) under ``audio``."""
    settings: dict[str, Any] = {}
    if model_path is None:
        return settings
    video = model_path / "video_preprocessor_config.json"
    if video.is_file():
        loaded = json.loads(video.read_text())
        if isinstance(loaded, dict):
            settings["video"] = loaded
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = model_path / name
        if path.is_file():
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                nested = loaded.get("image_processor")
                settings.update(nested if isinstance(nested, dict) else loaded)
                settings["audio"] = {k: loaded[k] for k in _AUDIO_SETTINGS if k in loaded}
    return settings


_AUDIO_SETTINGS = ("audio_seq_length", "audio_ms_per_token", "feature_extractor")
