"""Gemma 4's audio clip as its audio tower reads it: mlx-vlm's own feature extractor's frames.

The prompt side gives a clip's waveform (mono float32 at 16 kHz) and the processor's
``feature_extractor`` settings (``Gemma4Format.read_audio``); here mlx-vlm's
``Gemma4AudioFeatureExtractor`` (the one its ``Gemma4Processor`` builds from the same
settings) turns it into log-mel frames and their mask, as the processor does for one clip
(a list of one waveform, padded to a multiple of 128 samples). Those are what mlx-vlm's
``get_input_embeddings`` reads as ``input_features`` / ``input_features_mask``. numpy
work, run on the engine thread when the clip's tower runs (a cached clip's never is).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np


@lru_cache(maxsize=4)
def _extractor(settings: tuple[tuple[str, Any], ...]) -> Any:
    """mlx-vlm's extractor for ``settings`` (its mel filters are built once per settings)."""
    from mlx_vlm.models.gemma4.audio_feature_extractor import Gemma4AudioFeatureExtractor

    given: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in settings}
    return Gemma4AudioFeatureExtractor(**given)


def audio_tower_inputs(waveform: np.ndarray, settings: tuple[tuple[str, Any], ...],
                       ) -> dict[str, mx.array]:
    """``input_features`` (1, frames, mel bins) and ``input_features_mask`` (1, frames) for
    one clip, as mlx-vlm's processor gives them."""
    extractor = _extractor(settings)
    out = extractor([waveform], sampling_rate=extractor.sampling_rate,
                    return_attention_mask=True)
    return {"input_features": mx.array(np.stack(out["input_features"])),
            "input_features_mask": mx.array(np.stack(out["input_features_mask"]))}
