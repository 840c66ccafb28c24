"""Prompt tokens as prefix reuse keys them when the prompt holds images. No mlx.

Every image of a family occupies the same token ids, so two prompts that differ only in
their image look alike to a cache keyed on tokens: the bug of serving one request's image
to another. Image rows are keyed with each image span replaced by ids of that image.

Where images sit on a grid of positions (M-RoPE), an image row's cache is kept shifted to
the positions of the text after its images (``vision_prefill``), the text before them
included: its first token is keyed by that shift too, so a text row never resumes it.
"""

from __future__ import annotations

from typing import Any


def position_shift(images: tuple[Any, ...]) -> int:
    """How far the text after these images is from its index in positions: nonzero where
    images sit on a grid of positions (M-RoPE)."""
    return sum(image.positions - image.length for image in images)


def reuse_key(tokens: list[int], images: tuple[Any, ...]) -> list[int]:
    """``tokens`` as prefix reuse must see them: each image span's ids (the same for every
    image) replaced by negative ids from that image's hash and position, so a cached prefix
    is never resumed across a different image at the same span. Fits int64 (the disk tier)."""
    if not images:
        return tokens
    keyed = list(tokens)
    for image in images:
        base = int(image.key[:10], 16) << 20
        for j in range(image.start, min(image.start + image.length, len(keyed))):
            keyed[j] = -1 - (base + j - image.start)
    shift = position_shift(images)
    if shift and keyed:
        keyed[0] = -(1 << 61) - (shift & 0xFFFFFFFF)  # below every image id above
    return keyed


def adapter_tag(name: str) -> int:
    """The id an adapter row's first token is keyed by: below every image id and shift tag,
    so its cached prefixes serve only rows of the same adapter."""
    import hashlib

    digest = int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)
    return -(1 << 62) - digest
