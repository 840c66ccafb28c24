"""The loop guard inside constrained JSON strings, on a hand-made vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from engine.requests.constraints.string_repeats import StringRepeats, refuse_in_bitmask

# id -> bytes: structure tokens and words.
VOCAB = [b'{"', b'k', b'": "', b"a", b" b", b" c", b'"', b"}", b'\\"', b'x"y', b"", b'", "']
OPEN_KEY, K, OPEN_VALUE, A, B, C, QUOTE, CLOSE, ESCAPED, QUOTE_INSIDE, SPECIAL, NEXT = range(12)


def fed(tokens: list[int], ngram: int = 3) -> StringRepeats:
    repeats = StringRepeats(VOCAB, ngram)
    for token in tokens:
        repeats.advance(token)
    return repeats


def test_an_ngram_already_in_the_string_is_refused() -> None:
    repeats = fed([OPEN_KEY, K, OPEN_VALUE, A, B, C, A, B])
    assert repeats.in_string
    assert repeats.refused() == [C]


def test_nothing_is_refused_outside_strings_or_before_n_tokens() -> None:
    assert fed([OPEN_KEY, K, OPEN_VALUE, A, B, C, A, B, QUOTE]).refused() == []
    assert fed([OPEN_KEY, K, OPEN_VALUE, A]).refused() == []


def test_each_string_starts_a_fresh_history() -> None:
    # "a b c" in the first value, then "a b" in the next: another string, nothing refused.
    repeats = fed([OPEN_KEY, K, OPEN_VALUE, A, B, C, NEXT, A, B])
    assert repeats.in_string
    assert repeats.refused() == []


def test_an_escaped_quote_does_not_end_the_string() -> None:
    repeats = fed([OPEN_KEY, K, OPEN_VALUE, A, ESCAPED, A, ESCAPED])
    assert repeats.in_string
    assert repeats.refused() == [A]  # ngram 3: "a \\\"" was followed by "a" before


def test_a_quote_inside_a_token_ends_the_string() -> None:
    repeats = fed([OPEN_KEY, K, OPEN_VALUE, A, QUOTE_INSIDE])
    assert not repeats.in_string


def test_tokens_without_bytes_change_nothing() -> None:
    assert fed([OPEN_KEY, K, OPEN_VALUE, A, SPECIAL, B, C, A, B]).refused() == [C]


def test_ngram_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="ngram"):
        StringRepeats(VOCAB, 1)


def _mask(allowed: list[int], vocab: int = 64) -> np.ndarray:  # type: ignore[type-arg]
    words = np.zeros((1, (vocab + 31) // 32), dtype=np.uint32)
    for token in allowed:
        words[0, token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)


def _allowed(mask: np.ndarray) -> list[int]:  # type: ignore[type-arg]
    bits = mask.view(np.uint32)[0]
    return [t for t in range(bits.size * 32) if bits[t // 32] >> np.uint32(t % 32) & 1]


def test_refusing_clears_allowed_tokens_only_bit_31_included() -> None:
    mask = _mask([3, 31, 40])
    assert refuse_in_bitmask(mask, [31, 5, 40]) == 2
    assert _allowed(mask) == [3]


def test_the_grammar_wins_when_refusing_would_leave_nothing() -> None:
    mask = _mask([7, 63])
    assert refuse_in_bitmask(mask, [7, 63]) == 0
    assert _allowed(mask) == [7, 63]
