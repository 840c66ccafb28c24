"""Audio parts of chat messages: read from each door's shape, decoded once, checked.

An audio clip arrives as one of these parts (the rulebook, ``messages``, calls
``audio_of_part``):

- ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``: OpenAI's
  chat completions part (``format`` one of ``wav``, ``mp3``, ``flac``);
- ``{"type": "audio", "base64": ..., "mime_type": "audio/wav"}`` (or ``"url"`` a data:
  URI): LangChain v1's standard audio block (LlamaIndex's ``AudioBlock`` is converted to it).

Nothing is fetched and no path is read from a wire request. The clip is decoded on the
caller's thread (miniaudio, which the ``vision`` extra brings with mlx-vlm) to mono float32
at ``RATE`` Hz, the rate the audio towers read; bytes that are not audio, a clip longer
than ``MAX_SECONDS`` or larger than ``MAX_BYTES`` are refused naming the part. No mlx.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError
from engine.requests.inbound.images import media_bytes, standard_block_source

# Content part types that carry audio.
AUDIO_PARTS = frozenset({"input_audio", "audio"})
FORMATS = frozenset({"wav", "mp3", "flac"})
RATE = 16_000  # what Gemma 3n's, Gemma 4's and Qwen-Omni's feature extractors read
MAX_SECONDS = 600.0
MAX_BYTES = 128 * 1024 * 1024


class DecodedAudio:
    """One clip: mono float32 samples at ``RATE`` Hz, and the hash of its samples (which
    keys the feature cache and prefix reuse)."""

    __slots__ = ("at", "digest", "samples")

    def __init__(self, samples: np.ndarray, at: str = "") -> None:
        self.samples = samples
        self.digest = hashlib.sha256(samples.tobytes()).hexdigest()
        self.at = at

    @property
    def seconds(self) -> float:
        return len(self.samples) / RATE

    def __repr__(self) -> str:
        return f"DecodedAudio({self.seconds:.2f} s, {self.digest[:12]}, at={self.at!r})"


def audio_of_part(part: Mapping[str, Any], at: str) -> DecodedAudio:
    """The clip of an audio content part (``AUDIO_PARTS``), decoded; refusals name ``at``."""
    if part.get("type") == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, Mapping) or not isinstance(body.get("data"), str):
            raise InvalidRequestError(f"{at}.input_audio: an 'input_audio' part needs "
                                      "{'data': <base64>, 'format': 'wav' | 'mp3' | 'flac'}",
                                      f"{at}.input_audio")
        kind = body.get("format")
        if kind is not None and kind not in FORMATS:
            raise InvalidRequestError(f"{at}.input_audio.format: {kind!r:.20} audio is not "
                                      f"read; send one of {sorted(FORMATS)}",
                                      f"{at}.input_audio.format")
        source = str(body["data"])
    else:
        source = standard_block_source(part, at, "audio", "audio/wav")
    return decoded_audio(media_bytes(source, at, "audio"), at)


def decoded_audio(data: bytes, at: str) -> DecodedAudio:
    """Decode wav/mp3/flac bytes to mono float32 at ``RATE`` Hz; refusals name ``at``."""
    if len(data) > MAX_BYTES:
        raise InvalidRequestError(f"{at}: the audio has {len(data)} bytes, over the limit of "
                                  f"{MAX_BYTES}", at)
    try:
        import miniaudio
    except ImportError as exc:
        raise InvalidRequestError(f"{at}: reading audio needs miniaudio, which the vision "
                                  "extra brings: pip install 'mlx-providers[vision]'",
                                  at) from exc
    try:
        decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.FLOAT32,
                                   nchannels=1, sample_rate=RATE)
    except miniaudio.DecodeError as exc:
        raise InvalidRequestError(f"{at}: not readable audio (wav, mp3 or flac: {exc})",
                                  at) from exc
    samples = np.asarray(decoded.samples, dtype=np.float32)
    if not len(samples):
        raise InvalidRequestError(f"{at}: the audio has no samples", at)
    if len(samples) / RATE > MAX_SECONDS:
        raise InvalidRequestError(f"{at}: the audio lasts {len(samples) / RATE:.0f} s, over "
                                  f"the limit of {MAX_SECONDS:.0f} s; cut it first", at)
    return DecodedAudio(samples, at)
