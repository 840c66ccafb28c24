"""Video parts of chat messages: read from each door's shape, probed once, frames on demand.

A video arrives as one of these parts (the rulebook, ``messages``, calls ``video_of_part``):

- ``{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}``: the chat
  completions door (vLLM's name for it);
- ``{"type": "video", "base64": ..., "mime_type": "video/mp4"}`` (or ``"url"``/``"data"``):
  LangChain v1's standard video block (LlamaIndex's ``VideoBlock`` is converted to it).

As with images, the bytes are a ``data:`` URI or base64: nothing is fetched, no path is
read from a wire request. The container is probed on the caller's thread (OpenCV, which
the ``vision`` extra brings with mlx-vlm): a file that is not a video, has no frames, is
longer than ``MAX_SECONDS``, larger than ``MAX_BYTES`` or has frames over ``MAX_PIXELS``
is refused naming its part. Frames are decoded when the tower first needs them, at the
indices the family's own sampling picks (``sample_indices``). No mlx.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError
from engine.requests.inbound.audio import AUDIO_PARTS
from engine.requests.inbound.images import IMAGE_PARTS, media_bytes, standard_block_source

# Content part types that carry a video.
VIDEO_PARTS = frozenset({"video_url", "video"})
# Parts whose reading decodes media (work for a worker thread, not an event loop).
MEDIA_PARTS = IMAGE_PARTS | VIDEO_PARTS | AUDIO_PARTS
MAX_BYTES = 512 * 1024 * 1024  # an encoded video above this is refused
MAX_SECONDS = 600.0  # ten minutes: longer videos are refused (sample them down first)
MAX_PIXELS = 8_294_400  # a frame above 4K (3840 x 2160) is refused


class DecodedVideo:
    """One video: its frame count, rate and size, the hash of its bytes, and its frames on
    demand (``frames``). ``digest`` keys the feature cache and prefix reuse."""

    __slots__ = ("_data", "at", "digest", "fps", "frame_count", "size")

    def __init__(self, data: bytes, digest: str, frame_count: int, fps: float,
                 size: tuple[int, int], at: str = "") -> None:
        self._data = data
        self.digest = digest
        self.frame_count = frame_count
        self.fps = fps
        self.size = size  # (width, height)
        self.at = at

    @property
    def seconds(self) -> float:
        return self.frame_count / self.fps

    def frames(self, indices: list[int]) -> np.ndarray:
        """RGB frames (len(indices), height, width, 3; uint8) at ``indices``, in order."""
        import cv2

        wanted = sorted(set(indices))
        found: dict[int, np.ndarray] = {}
        with _spooled(self._data) as path:
            capture = cv2.VideoCapture(path)
            try:
                index = 0
                for target in wanted:
                    while index <= target:  # read, not seek: exact on every codec
                        ok, frame = capture.read()
                        if not ok:
                            raise InvalidRequestError(
                                f"{self.at}: the video ended at frame {index}, before the "
                                f"{self.frame_count} its container declares", self.at)
                        if index == target:
                            found[target] = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                        index += 1
            finally:
                capture.release()
        return np.stack([found[i] for i in indices])

    def __repr__(self) -> str:
        return (f"DecodedVideo({self.size[0]}x{self.size[1]}, {self.frame_count} frames at "
                f"{self.fps:g} fps, {self.digest[:12]}, at={self.at!r})")


def video_of_part(part: Mapping[str, Any], at: str) -> DecodedVideo:
    """The video of a video content part (``VIDEO_PARTS``), probed; refusals name ``at``."""
    if part.get("type") == "video":
        source = standard_block_source(part, at, "video", "video/mp4")
    else:
        url = part.get("video_url")
        if isinstance(url, Mapping):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{at}.video_url: a 'video_url' part needs the video as "
                                      f"a data: URI, got {type(url).__name__}",
                                      f"{at}.video_url")
        source = url
    return decoded_video(media_bytes(source, at, "video"), at)


def decoded_video(data: bytes, at: str) -> DecodedVideo:
    """Probe encoded video bytes; refusals (not a video, no frames, too long, too large)
    name ``at``."""
    if len(data) > MAX_BYTES:
        raise InvalidRequestError(f"{at}: the video has {len(data)} bytes, over the limit of "
                                  f"{MAX_BYTES}", at)
    try:
        import cv2
    except ImportError as exc:
        raise InvalidRequestError(f"{at}: reading videos needs OpenCV, which the vision extra "
                                  "brings: pip install 'mlx-providers[vision]'", at) from exc
    with _spooled(data) as path:
        capture = cv2.VideoCapture(path)
        try:
            opened = capture.isOpened()
            count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) if opened else 0
            fps = float(capture.get(cv2.CAP_PROP_FPS)) if opened else 0.0
            size = (int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
                    int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))) if opened else (0, 0)
        finally:
            capture.release()
    if not opened or count <= 0 or size[0] <= 0 or size[1] <= 0:
        raise InvalidRequestError(f"{at}: not a readable video (no frames found)", at)
    if not math.isfinite(fps) or fps <= 0:
        raise InvalidRequestError(f"{at}: the video declares no frame rate", at)
    if count / fps > MAX_SECONDS:
        raise InvalidRequestError(f"{at}: the video lasts {count / fps:.0f} s, over the limit "
                                  f"of {MAX_SECONDS:.0f} s; cut it or sample it down first", at)
    if size[0] * size[1] > MAX_PIXELS:
        raise InvalidRequestError(f"{at}: the video's frames are {size[0]}x{size[1]}, over the "
                                  f"limit of {MAX_PIXELS} pixels; scale it down first", at)
    return DecodedVideo(data, hashlib.sha256(data).hexdigest(), count, fps, size, at)


def sample_indices(frame_count: int, fps: float, *, rate: float, factor: int,
                   min_frames: int, max_frames: int) -> list[int]:
    """The frames Qwen-VL's video reader takes: ``rate`` a second, at least ``min_frames``
    and at most ``max_frames`` (and no more than the video has, to a multiple of
    ``factor``), evenly spaced from the first frame to the last."""
    wanted = frame_count / fps * rate
    ceiling = math.floor(min(max_frames, frame_count) / factor) * factor
    floor = math.ceil(min_frames / factor) * factor
    count = min(max(wanted, floor), ceiling)
    count = max(factor, round(count / factor) * factor)
    return [int(i) for i in np.linspace(0, frame_count - 1, count).round()]


class _spooled:
    """The bytes in a temporary file for OpenCV (which reads containers from paths only)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._path = ""

    def __enter__(self) -> str:
        handle, self._path = tempfile.mkstemp(suffix=".video")
        with os.fdopen(handle, "wb") as out:
            out.write(self._data)
        return self._path

    def __exit__(self, *exc: object) -> None:
        os.unlink(self._path)
