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
its defaults otherwise: 16 px patches pooled 3x3, 280 tokens).

Audio, where the checkpoint has an audio tower (``audio_config``: the small models), as
mlx-vlm's ``Gemma4Processor`` writes a clip: ``<|audio>``, one ``<|audio|>`` per
``audio_ms_per_token`` (40) ms of the clip rounded up (at most ``audio_seq_length``, 750),
``<audio|>``. The tower reads the clip's log-mel frames from mlx-vlm's own feature extractor
(run on the engine's side, ``engine.device.vision.gemma4_audio``, with the processor's
``feature_extractor`` settings); it truncates a clip at 30 s, so a longer clip is refused
here rather than silently cut. A checkpoint without an audio tower refuses audio by name.
No mlx here (numpy and Pillow).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError
from engine.requests.inbound.audio import RATE, DecodedAudio
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
    # Audio: its token (None: the checkpoint has no audio tower), the block's marks, the
    # processor's token budget and pace, the feature extractor's settings (sorted pairs).
    audio_token: int | None = None
    audio_start: int = 0  # <|audio>
    audio_end: int = 0  # <audio|>
    audio_max_tokens: int = 750
    audio_ms_per_token: float = 40.0
    audio_extractor: tuple[tuple[str, Any], ...] = ()

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

    def read_audio(self, audio: DecodedAudio) -> list[ImageTokens]:
        if self.audio_token is None:
            return super().read_audio(audio)
        samples = len(audio.samples)
        if samples > AUDIO_MAX_SAMPLES:
            raise InvalidRequestError(
                f"{audio.at}: the audio lasts {samples / RATE:.1f} s; this model reads at "
                f"most {AUDIO_MAX_SAMPLES / RATE:.0f} s a clip (its feature extractor would "
                "cut the rest): cut it into clips", audio.at)
        # The processor's count, in its own arithmetic (a clip's duration in ms, rounded up).
        count = min(math.ceil(samples / RATE * 1000.0 / self.audio_ms_per_token),
                    self.audio_max_tokens)
        return [ImageTokens((self.audio_start, *([self.audio_token] * count), self.audio_end),
                            {"feature_extractor": self.audio_extractor},
                            token=self.audio_token)]

    def audio_features(self, audio: DecodedAudio) -> np.ndarray:
        return audio.samples


# mlx-vlm's feature extractor truncates a clip to its ``max_length`` (the processor leaves
# it at the default: 30 s at 16 kHz), while the prompt's tokens stop at 750 (30 s).
AUDIO_MAX_SAMPLES = 480_000


def _frozen(value: Any) -> Any:
    """A settings value as a hashable one (lists as tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _audio(config: Mapping[str, Any], tokenizer: Any,
           processor: Mapping[str, Any]) -> dict[str, Any]:
    """The format's audio fields: none where the checkpoint has no audio tower."""
    if not isinstance(config.get("audio_config"), Mapping):
        return {}
    settings = processor.get("audio")
    settings = settings if isinstance(settings, Mapping) else {}
    extractor = settings.get("feature_extractor")
    extractor = {k: v for k, v in (extractor.items() if isinstance(extractor, Mapping)
                                   else ()) if k != "feature_extractor_type"}
    return {"audio_token": int(config.get("audio_token_id", token_id(tokenizer, "<|audio|>"))),
            "audio_start": int(config.get("boa_token_id", token_id(tokenizer, "<|audio>"))),
            "audio_end": int(config.get("eoa_token_id", token_id(tokenizer, "<audio|>"))),
            "audio_max_tokens": int(settings.get("audio_seq_length", 750)),
            "audio_ms_per_token": float(settings.get("audio_ms_per_token", 40)),
            "audio_extractor": tuple(sorted((str(k), _frozen(v))
                                            for k, v in extractor.items()))}


def build_gemma4(config: Mapping[str, Any], tokenizer: Any,
                 processor: Mapping[str, Any]) -> VisionFormat:
    """Gemma 4's format from its processor settings (mlx-vlm's defaults where unset) and its
    tokenizer's image (and, with an audio tower, audio) tokens."""
    marks = (int(config.get("image_token_id", token_id(tokenizer, "<|image|>"))),
             int(config.get("boi_token_id", token_id(tokenizer, "<|image>"))),
             int(config.get("eoi_token_id", token_id(tokenizer, "<image|>"))))
    audio = _audio(config, tokenizer, processor)
    audio_marks = tuple(audio[k] for k in ("audio_token", "audio_start", "audio_end")
                        if k in audio)
    return Gemma4Format(
        str(config.get("model_type")), *marks, int(processor.get("patch_size", 16)),
        int(processor.get("pooling_kernel_size", 3)),
        int(processor.get("max_soft_tokens", 280)), bool(processor.get("do_resize", True)),
        float(processor.get("rescale_factor", 1 / 255)) if processor.get("do_rescale", True)
        else 1.0, bool(processor.get("do_normalize", False)),
        tuple(float(v) for v in processor.get("image_mean") or (0.5,) * 3),
        tuple(float(v) for v in processor.get("image_std") or (0.5,) * 3),
        spelling_of(tokenizer, (*marks, *audio_marks)), **audio)
