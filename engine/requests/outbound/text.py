"""Per-row text: streaming detokenization plus stop strings matched across tokens.

A suffix of the text that could still become a stop string is held back, so stop
text is never streamed; when the row ends for another reason the held text is real
output and is released. The streamed text is the tokenizer's decode of the row's tokens:
whitespace the streaming detokenizer trims from the start of the output and the decode
keeps (mlx-lm's byte-level BPE one drops the space of a first token like gpt-oss's
" to=functions...") is put back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class StreamingDetokenizer(Protocol):
    """The part of mlx-lm's streaming detokenizers this module uses."""

    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


class RowText:
    """Turns one row's tokens into safe-to-stream text deltas."""

    def __init__(self, detokenizer: StreamingDetokenizer | Any, stop: tuple[str, ...],
                 decode: Callable[[list[int]], str] | None = None) -> None:
        """``decode``: the tokenizer's, which the first text is checked against."""
        self._detokenizer = detokenizer
        self._stop = stop
        self._held = ""
        self.text = ""  # everything streamed so far
        self.stopped = False  # a stop string matched
        self._decode = decode
        # The tokens before the first text, while it has not come (None after, or no decode).
        self._before_text: list[int] | None = [] if decode is not None else None

    def add_token(self, token: int) -> str:
        """Feed one generated token; returns the text that may be streamed now."""
        if self.stopped:
            return ""
        self._detokenizer.add_token(token)
        segment = self._detokenizer.last_segment
        if self._before_text is not None:
            self._before_text.append(token)
            if segment:
                segment = self._first_text(segment)
        return self._release(segment)

    def finish(self) -> str:
        """The row ended (not on a stop string): flush the detokenizer and held text."""
        if self.stopped:
            return ""
        self._detokenizer.finalize()
        segment = self._detokenizer.last_segment
        if self._before_text:
            segment = self._first_text(segment)
        tail = self._held + segment
        self._held = ""
        if self._stop:
            cut = _first_stop(tail, self._stop)
            if cut is not None:
                self.stopped = True
                tail = tail[:cut]
        self.text += tail
        return tail

    def _first_text(self, segment: str) -> str:
        """The output's first text, with the leading whitespace the decode of the same
        tokens has and the detokenizer trimmed (nothing is held back when text comes)."""
        assert self._decode is not None and self._before_text is not None
        whole = self._decode(self._before_text)
        self._before_text = None
        lost = whole[: len(whole) - len(segment)]
        return lost + segment if whole.endswith(segment) and lost.isspace() else segment

    def _release(self, segment: str) -> str:
        if not self._stop:
            self.text += segment
            return segment
        buffer = self._held + segment
        cut = _first_stop(buffer, self._stop)
        if cut is not None:
            self.stopped = True
            self._held = ""
            out = buffer[:cut]
        else:
            keep = partial_suffix(buffer, self._stop)
            out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.text += out
        return out


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    positions = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(positions) if positions else None


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a marker (a stop string,
    a channel or call marker): held back until the next text says whether it is there."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
