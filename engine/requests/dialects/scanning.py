"""Small text scans the family splitters share: the first of several markers in a text, the
start of a marker held at a text's end, and where a JSON value that streams in ends.
No mlx here.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.requests.outbound.channels import JsonStrings
from engine.requests.outbound.text import partial_suffix

__all__ = ["JsonEnd", "first_marker", "partial_suffix"]


def first_marker(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """(offset, marker) of the earliest marker in ``text``; (-1, "") when none is there.
    At the same offset the longer marker wins (one marker may start another)."""
    best = (-1, "")
    for marker in markers:
        index = text.find(marker) if marker else -1
        if index < 0:
            continue
        if best[0] < 0 or index < best[0] or (index == best[0] and len(marker) > len(best[1])):
            best = (index, marker)
    return best


class JsonEnd:
    """Finds where one JSON object or array ends as its text arrives, a piece at a time
    (strings and escapes respected). Whitespace before it is skipped; a value that does not
    open with ``{`` or ``[`` is ``malformed`` and never ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.malformed = False
        self._strings = JsonStrings()

    def feed(self, text: str) -> int:
        """Offset in ``text`` just after the value's last character; -1 if it has not ended."""
        for i, ch in enumerate(text):
            if self.malformed:
                return -1
            if not self.started:
                if ch in " \t\r\n":
                    continue
                self.started = True
                if ch not in "{[":
                    self.malformed = True
                    return -1
                self.depth = 1
                continue
            was_inside = self._strings.inside
            self._strings.step(ch)
            if was_inside or self._strings.inside:
                continue  # string text, or the quote that opened it
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1
