"""engine.core.reuse_key: two rows share a cached prefix only where their KV is the same.

The property, over generated rows: the common prefix of two rows' reuse keys is never
longer than the tokens whose KV the two really share (same ids, same images at the same
spans, same position shift, same adapter). No mlx.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.prefix_cache import common_prefix as common_array_prefix
from engine.core.reuse_key import RowContext, reuse_key


@dataclass(frozen=True)
class Image:
    """What the key reads of a ``PromptImage``."""

    start: int
    length: int
    key: str
    grid: tuple[int, int] | None = None

    @property
    def positions(self) -> int:
        return self.length if self.grid is None else max(self.grid)


@dataclass(frozen=True)
class Row:
    tokens: list[int]
    context: RowContext


def common_prefix(a: list[int], b: list[int]) -> int:
    """The store's own comparison, on keys as it holds them (int64 arrays)."""
    return common_array_prefix(np.asarray(a, np.int64), np.asarray(b, np.int64))


IMAGE_ID = 7  # every image token of a family has the same id


@st.composite
def rows(draw: st.DrawFn) -> Row:
    tokens = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    images = []
    at = 0
    for _ in range(draw(st.integers(0, 2))):
        start = draw(st.integers(at, at + 3))
        length = draw(st.integers(1, 4))
        tokens = tokens + [0] * max(0, start + length - len(tokens))
        tokens[start:start + length] = [IMAGE_ID] * length
        grid = draw(st.none() | st.sampled_from([(1, length), (length, 1)]))
        images.append(Image(start, length, draw(st.sampled_from(["aa" * 8, "bb" * 8])), grid))
        at = start + length
    adapter = draw(st.none() | st.sampled_from(["/a", "/b", "3"]))
    return Row(tokens, RowContext(tuple(images), adapter))


def truly_shared(a: Row, b: Row) -> int:
    """How many leading tokens hold the same KV in both rows."""
    if a.context.adapter != b.context.adapter or a.context.shift != b.context.shift:
        return 0

    def image_at(row: Row, j: int) -> tuple[str, int] | None:
        for image in row.context.images:
            if image.start <= j < image.start + image.length:
                return image.key, j - image.start
        return None

    n = 0
    for x, y in zip(a.tokens, b.tokens):
        if x != y or image_at(a, n) != image_at(b, n):
            break
        n += 1
    return n


@settings(max_examples=2000, deadline=None)
@given(a=rows(), b=rows())
def test_no_two_contexts_share_more_than_their_kv(a: Row, b: Row) -> None:
    shared = common_prefix(reuse_key(a.tokens, a.context), reuse_key(b.tokens, b.context))
    assert shared <= truly_shared(a, b)


@settings(max_examples=300, deadline=None)
@given(a=rows())
def test_a_row_shares_its_whole_key_with_itself_and_its_continuation(a: Row) -> None:
    key = reuse_key(a.tokens, a.context)
    longer = reuse_key([*a.tokens, 3, 4], a.context)
    assert longer[: len(key)] == key
    assert all(k >= 0 for k in reuse_key(a.tokens, RowContext()))


def test_the_adapter_and_the_shift_are_composed_not_overwritten() -> None:
    """The defect this module closes: an adapter's tag written over the shift's made a
    shifted image row and a text row of the same adapter share a cached prefix."""
    shifted = RowContext((Image(3, 4, "aa" * 8, grid=(2, 2)),), "/a")
    assert shifted.shift == -2
    text = RowContext((), "/a")
    tokens = [1, 2, 3, 7, 7, 7, 7, 5]
    assert common_prefix(reuse_key(tokens, shifted), reuse_key(tokens, text)) == 0
    assert common_prefix(reuse_key(tokens, shifted), reuse_key(tokens, RowContext(
        shifted.images))) == 0
    assert reuse_key(tokens, text)[0] != reuse_key(tokens, RowContext((), "/b"))[0]


def test_every_id_fits_the_disk_tiers_int64() -> None:
    context = RowContext((Image(0, 3, "f" * 16, grid=(3, 1)),), "x" * 300)
    assert all(-(2**63) <= k < 2**63 for k in reuse_key([7, 7, 7, 1], context))
