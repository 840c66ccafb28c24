"""Image parts of chat messages: read from each ecosystem's shape, decoded once, checked.

The rulebook (``messages``) calls ``image_of_part`` for a content part whose type is an
image's; every door's own image shape arrives here as one of these OpenAI-style parts:

- ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``): chat
  completions, LangChain's OpenAI-style blocks;
- ``{"type": "input_image", "image_url": "..."}``: the Responses API;
- ``{"type": "image", "base64": ..., "mime_type": ...}`` or ``"url"`` / ``"data"``:
  LangChain v1's standard image block (LlamaIndex's ``ImageBlock`` is converted to it).

The image itself is a ``data:`` URI or base64 text: this engine fetches nothing. A remote
``http(s)`` URL is refused unless the caller's ``ImagePolicy.fetch`` allows it; a local
path is read only where a face says so (LlamaIndex's ``ImageBlock.path``), never from a
wire request. Decoding (Pillow, the ``vision`` extra) happens where the image is read, on
the caller's thread, so a bad image is refused before the engine sees the request: not an
image, truncated, an unsupported format, or more pixels than ``MAX_PIXELS``. No mlx.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError

# Content part types that carry an image.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
# The formats Pillow decodes that are images a vision model reads (not animations' frames).
FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"})
# A decoded image above this many pixels is refused (40 MP: a 4K screenshot is 8.3 MP).
MAX_PIXELS = 40_000_000
# Stands for an image in a message's rendered text, where the model's image tokens go.
IMAGE_MARK = "\ufffc"  # OBJECT REPLACEMENT CHARACTER: Unicode's own "an object is here"


# Images decoded lately, by a hash of their encoded bytes: an agent sends the same
# screenshot again with every later turn, which then costs a hash, not a decode.
_SEEN_LIMIT = 256


class DecodedImage:
    """One image: its size, the hash of its decoded RGB pixels, and the pixels on demand.

    ``digest`` keys the feature cache and prefix reuse: two parts with the same pixels are
    the same image, whatever their encoding. The pixels (height, width, 3; uint8) are
    decoded when first read (``pixels``): a later turn whose image's features or prefix
    are cached never decodes it again."""

    __slots__ = ("_data", "_pixels", "at", "digest", "size")

    def __init__(self, data: bytes, digest: str, size: tuple[int, int], at: str = "",
                 pixels: np.ndarray | None = None) -> None:
        self._data = data
        self._pixels = pixels
        self.digest = digest
        self.size = size  # (width, height)
        self.at = at  # the part it came from, for errors

    @property
    def pixels(self) -> np.ndarray:
        if self._pixels is None:
            self._pixels = _decode(self._data, self.at)[0]
        return self._pixels

    def __repr__(self) -> str:
        return f"DecodedImage({self.size[0]}x{self.size[1]}, {self.digest[:12]}, at={self.at!r})"


_seen: OrderedDict[bytes, tuple[str, tuple[int, int]]] = OrderedDict()
_seen_lock = threading.Lock()


def image_of_part(part: Mapping[str, Any], at: str) -> DecodedImage:
    """The image of an image content part (``IMAGE_PARTS``), decoded; refusals name ``at``."""
    kind = part.get("type")
    if kind == "image":
        source = standard_block_source(part, at)
    else:
        url = part.get("image_url")
        if isinstance(url, Mapping):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{at}.image_url: an {kind!r} part needs the image as a "
                                      "data: URI (or its url), got "
                                      f"{type(url).__name__}", f"{at}.image_url")
        source = url
    return decoded_image(media_bytes(source, at), at)


def standard_block_source(part: Mapping[str, Any], at: str, kind: str = "image",
                          default_mime: str = "image/png") -> str:
    """LangChain v1's media block (an image, video or audio: ``kind``): base64
    (``base64`` or v0's ``data``, typed by ``mime_type``) or a ``url``."""
    for key in ("base64", "data"):
        data = part.get(key)
        if isinstance(data, str) and data:
            mime = part.get("mime_type") or default_mime
            return data if data.startswith("data:") else f"data:{mime};base64,{data}"
    url = part.get("url")
    if isinstance(url, str) and url:
        return url
    if part.get("file_id") is not None or part.get("id") is not None:
        article = "an" if kind[0] in "aeiou" else "a"
        raise InvalidRequestError(f"{at}: {article} {kind} block by file id cannot be read "
                                  f"here: send the {kind} itself (base64 or a data: URI)", at)
    raise InvalidRequestError(f"{at}: an '{kind}' block needs 'base64' (with 'mime_type') or "
                              "'url' (a data: URI)", at)


def media_bytes(source: str, at: str, kind: str = "image") -> bytes:
    """The encoded bytes (of an image, or a video: ``kind``) of a data: URI or bare
    base64; remote URLs and paths are refused."""
    if source.startswith(("http://", "https://")):
        raise InvalidRequestError(
            f"{at}: remote {kind} URLs are not fetched (no network access from the engine): "
            f"send the {kind} as a data: URI or base64", at)
    bare = not source.startswith("data:")  # neither a URL nor a data: URI: base64 or a path
    if not bare:
        head, sep, data = source.partition(",")
        if not sep:
            raise InvalidRequestError(f"{at}: a data: URI needs a ',' before its data", at)
        if not head.endswith(";base64"):
            raise InvalidRequestError(f"{at}: a data: URI's {kind} must be base64 "
                                      f"(data:<mime>;base64,...), got {head[:40]!r}", at)
        source = data
    elif source.startswith("file:"):
        raise InvalidRequestError(f"{at}: local paths are not read from a request: send the "
                                  f"{kind} as a data: URI or base64", at)
    try:
        return _b64decoded(source.strip())
    except (binascii.Error, ValueError) as exc:
        hint = (" (nor a data: URI: local paths are not read from a request)" if bare
                else "")
        raise InvalidRequestError(f"{at}: the {kind} is not valid base64{hint} ({exc})",
                                  at) from exc


# Base64 is decoded this many characters at a time (a multiple of 4): CPython's decoder
# holds the GIL throughout (~0.35 s for a 12 MP PNG here), which would stall every other
# thread, an event loop that handed the conversion to a worker among them.
_B64_PIECE = 1 << 20


def _b64decoded(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)``, a piece at a time."""
    if len(text) <= _B64_PIECE:
        return base64.b64decode(text, validate=True)
    if "=" in text.rstrip("="):  # padding inside: pieces would each accept it
        raise binascii.Error("padding before the end of the data")
    return b"".join(base64.b64decode(text[i:i + _B64_PIECE], validate=True)
                    for i in range(0, len(text), _B64_PIECE))


def decoded_image(data: bytes, at: str, *, max_pixels: int = MAX_PIXELS) -> DecodedImage:
    """Decode encoded image bytes to RGB; not an image, truncated, an unsupported format or
    too many pixels is an ``InvalidRequestError`` naming ``at``. Bytes seen lately are not
    decoded again (their pixels are, if ever read)."""
    key = hashlib.sha256(data).digest()
    with _seen_lock:
        seen = _seen.get(key)
        if seen is not None:
            _seen.move_to_end(key)
    if seen is not None and seen[1][0] * seen[1][1] <= max_pixels:
        return DecodedImage(data, seen[0], seen[1], at)
    pixels, size = _decode(data, at, max_pixels)
    digest = hashlib.sha256(np.array(pixels.shape, np.int64).tobytes()
                            + pixels.tobytes()).hexdigest()
    with _seen_lock:
        _seen[key] = (digest, size)
        while len(_seen) > _SEEN_LIMIT:
            _seen.popitem(last=False)
    return DecodedImage(data, digest, size, at, pixels)


def _decode(data: bytes, at: str, max_pixels: int = MAX_PIXELS,
            ) -> tuple[np.ndarray, tuple[int, int]]:
    """(RGB pixels, (width, height)); refusals name ``at``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # the core install is text-only
        raise InvalidRequestError(
            f"{at}: reading images needs Pillow: pip install 'mlx-providers[vision]'",
            at) from exc
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise InvalidRequestError(
                    f"{at}: {image.format or 'this'} images are not read; send one of "
                    f"{sorted(FORMATS)}", at)
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequestError(
                    f"{at}: the image has {width}x{height} = {width * height} pixels, over "
                    f"the limit of {max_pixels}; scale it down first", at)
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError,
            Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"{at}: not a readable image ({exc})", at) from exc
    if pixels.ndim != 3 or pixels.shape[0] == 0 or pixels.shape[1] == 0:
        raise InvalidRequestError(f"{at}: the image has no pixels", at)
    return pixels, (int(pixels.shape[1]), int(pixels.shape[0]))
