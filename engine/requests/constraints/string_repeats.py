"""Loops inside constrained JSON strings: the tokens that would repeat an n-gram.

Greedy small models loop inside the first free-text string of a JSON answer
(``"A cat is a cat, a cat is a cat, ..."``) until ``max_tokens`` cuts the JSON. The
grammar cannot stop that: every repetition is valid JSON. ``StringRepeats`` follows a
row's output byte by byte, knows when it is inside a JSON string, and names the tokens
that would complete an n-gram of tokens already written in *that* string, so the mask
can refuse them. It depends only on the row's own tokens, so greedy decoding stays
deterministic and a batched row equals its run alone.

Pure: token bytes in, token ids out; no llguidance, no mlx.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_QUOTE = 0x22
_BACKSLASH = 0x5C

DEFAULT_NGRAM = 4
"""Tokens in a refused n-gram: 4 lets short phrases recur and stops loops within a few tokens."""


class StringRepeats:
    """One row's JSON-string state and the n-grams of the string being written."""

    def __init__(self, token_bytes: Sequence[bytes], ngram: int = DEFAULT_NGRAM) -> None:
        if ngram < 2:
            raise ValueError(f"ngram must be >= 2, got {ngram}")
        self._token_bytes = token_bytes
        self._ngram = ngram
        self._in_string = False
        self._escaped = False
        self._span: list[int] = []  # tokens of the string being written
        self._followers: dict[tuple[int, ...], set[int]] = {}  # (n-1)-gram -> next tokens

    def copy(self) -> StringRepeats:
        """An independent copy of the state (a grammar's rollback point)."""
        twin = StringRepeats.__new__(StringRepeats)
        twin._token_bytes, twin._ngram = self._token_bytes, self._ngram
        twin._in_string, twin._escaped = self._in_string, self._escaped
        twin._span = list(self._span)
        twin._followers = {key: set(value) for key, value in self._followers.items()}
        return twin

    @property
    def in_string(self) -> bool:
        """Whether the output so far ends inside an open JSON string."""
        return self._in_string

    def advance(self, token: int) -> None:
        """Follow one written token (its bytes move the string state)."""
        data = self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""
        for byte in data:
            if not self._in_string:
                if byte == _QUOTE:
                    self._in_string = True
                    self._span, self._followers = [], {}
            elif self._escaped:
                self._escaped = False
            elif byte == _BACKSLASH:
                self._escaped = True
            elif byte == _QUOTE:
                self._in_string = False
        if self._in_string and data:
            self._append(token)

    def refused(self) -> list[int]:
        """Tokens that would repeat an n-gram of the open string (none outside strings)."""
        if not self._in_string or len(self._span) < self._ngram - 1:
            return []
        return sorted(self._followers.get(self._prefix(), ()))

    def _prefix(self) -> tuple[int, ...]:
        return tuple(self._span[len(self._span) - (self._ngram - 1):])

    def _append(self, token: int) -> None:
        if len(self._span) >= self._ngram - 1:
            self._followers.setdefault(self._prefix(), set()).add(token)
        self._span.append(token)


def refuse_in_bitmask(bitmask: np.ndarray[Any, Any], tokens: Sequence[int]) -> int:
    """Clear ``tokens`` in a (1, n) int32 llguidance bitmask unless that empties it.

    Returns how many allowed tokens were refused. When every allowed token would be
    refused (an ``enum`` or ``pattern`` string leaves no other way on), the mask is left
    as the grammar filled it: the grammar always wins over the loop guard.
    """
    mask = bitmask.view(np.uint32)
    cleared: list[tuple[int, np.uint32]] = []
    for token in tokens:
        word, bit = divmod(token, 32)
        if word < mask.shape[-1] and mask[0, word] >> np.uint32(bit) & np.uint32(1):
            cleared.append((word, mask[0, word]))
            mask[0, word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)
    if cleared and not mask.any():
        for word, value in reversed(cleared):
            mask[0, word] = value
        return 0
    return len(cleared)
