"""A row's tokens as prefix reuse keys them: the one place every tag of a row's KV is
composed. No mlx.

Two rows may resume each other's cached KV only where that KV is the same, which the
tokens alone do not say:

- **images**: every image of a family occupies the same token ids, so each image span is
  replaced by ids of that image (its hash and the position in the span);
- **position shift** (M-RoPE families): an image row's cache is kept shifted to the
  positions of the text after its images (``device.vision.prefill``), the text before them
  included;
- **adapter**: a LoRA adapter changes every layer's keys and values from the first token.

The last two change the KV of every token, so they are composed, with the first
token's own id, into one tag that replaces that id: rows of another shift or adapter never
share even one token. Whatever comes next that changes a row's KV belongs in
``RowContext`` and its tag. Every id fits int64 (the disk tier stores keys as such).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

# Bump when what a key means changes: the disk tier then never reads files keyed otherwise.
KEY_VERSION = 2

# Image span ids lie in [-(2**60 + 2**20), -1]; context tags below -(2**61), so neither
# can be mistaken for the other or for a real token id (>= 0).
_TAG_BASE = 1 << 61
_TAG_BITS = 60


def position_shift(images: tuple[Any, ...]) -> int:
    """How far the text after these images is from its index in positions: nonzero where
    images sit on a grid of positions (M-RoPE)."""
    return sum(image.positions - image.length for image in images)


@dataclass(frozen=True)
class RowContext:
    """What besides its token ids decides a row's KV."""

    images: tuple[Any, ...] = ()  # ``PromptImage``s: ``key``, ``start``, ``length``...
    adapter: str | None = None  # the resolved adapter name (None: the base model)
    # The shift its KV is kept at, where not its images' whole shift: a later turn looks
    # for the cache an earlier turn (fewer images) kept at that turn's shift.
    frame: int | None = None

    @property
    def shift(self) -> int:
        return position_shift(self.images) if self.frame is None else self.frame

    def tag(self, first: int) -> int | None:
        """The id that keys the first token (``first``) in this context; None where the
        context changes no token's KV."""
        shift = self.shift
        if not shift and self.adapter is None:
            return None
        # Every part spelled out with its name: ("shift", 3) never reads as an adapter "3".
        spelled = (f"first={first}\x00shift={shift}\x00"
                   f"adapter={'' if self.adapter is None else self.adapter!r}")
        digest = int(hashlib.sha256(spelled.encode()).hexdigest()[:15], 16)  # 60 bits
        return -_TAG_BASE - (digest & ((1 << _TAG_BITS) - 1))


def reuse_key(tokens: list[int], context: RowContext) -> list[int]:
    """``tokens`` as prefix reuse must see them in ``context``: image spans by their
    image, and the first token by the context's tag (its shift and adapter)."""
    if not tokens or (not context.images and context.tag(tokens[0]) is None):
        return tokens
    keyed = list(tokens)
    for image in context.images:
        base = int(image.key[:10], 16) << 20
        for j in range(image.start, min(image.start + image.length, len(keyed))):
            keyed[j] = -1 - (base + j - image.start)
    tag = context.tag(keyed[0])  # the first id as keyed so far: an image's, if it is one
    if tag is not None:
        keyed[0] = tag
    return keyed
