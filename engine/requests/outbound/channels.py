"""Split a row's streamed text into channels: content, reasoning, tool-call markup.

Markers (``<think>``/``</think>``, ``<tool_call>``/``</tool_call>``) are matched on text,
so they may arrive split across tokens; a suffix that could be the start of a marker
is held back until it is known. Markers themselves are never emitted. In a channel whose
text is JSON (a tool block of JSON calls), a close marker inside a JSON string is string
text: the grammar that wrote the call admits it there, so the reader must too.
"""

from __future__ import annotations

from typing import Protocol

from engine.requests.outbound.text import partial_suffix

CONTENT = "content"
REASONING = "reasoning"
TOOL = "tool"


class Splitter(Protocol):
    """A row's text sorted into channels as it streams; a model family may bring its own
    (``engine.requests.dialects``), ``ChannelSplitter`` splits on marker pairs."""

    @property
    def channel(self) -> str:
        """The channel the next text belongs to."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Pieces in order; a (channel, "") piece marks each switch of channel."""

    def flush(self) -> list[tuple[str, str]]:
        """The row ended: whatever was held back, as text of the current channel."""


class JsonStrings:
    """Whether a streaming JSON text is inside a string, a character at a time."""

    def __init__(self) -> None:
        self.inside = False
        self._escape = False

    def advance(self, text: str) -> None:
        for ch in text:
            self.step(ch)

    def step(self, ch: str) -> None:
        if not self.inside:
            self.inside = ch == '"'
        elif self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self.inside = False

    def copy(self) -> JsonStrings:
        twin = JsonStrings()
        twin.inside, twin._escape = self.inside, self._escape
        return twin


class ChannelSplitter:
    """Feeds text, returns (channel, text) pieces; ``markers`` maps channel -> (open, close).
    ``json_channels``: channels whose text is JSON, closed only by a marker outside its
    strings."""

    def __init__(self, markers: dict[str, tuple[str, str]], start: str = CONTENT,
                 json_channels: frozenset[str] = frozenset()) -> None:
        self._markers = {channel: pair for channel, pair in markers.items() if all(pair)}
        self._channel = start
        self._held = ""
        self._json_channels = json_channels
        self._strings = JsonStrings()  # of the current JSON channel's text so far

    @property
    def channel(self) -> str:
        return self._channel

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Pieces in order; a ("channel", "") piece marks each switch of channel."""
        buffer = self._held + text
        self._held = ""
        pieces: list[tuple[str, str]] = []
        while buffer:
            found = self._next_marker(buffer)
            if found is None:
                keep = self._partial_suffix(buffer)
                safe = buffer[: len(buffer) - keep]
                if safe:
                    pieces.append((self._channel, safe))
                    self._strings.advance(safe)
                self._held = buffer[len(buffer) - keep :]
                break
            index, marker, next_channel = found
            if index:
                pieces.append((self._channel, buffer[:index]))
            self._channel, self._strings = next_channel, JsonStrings()
            pieces.append((next_channel, ""))  # marks the switch, even with no text yet
            buffer = buffer[index + len(marker) :]
        return pieces

    def flush(self) -> list[tuple[str, str]]:
        """The row ended: whatever was held back is plain text of the current channel."""
        held, self._held = self._held, ""
        return [(self._channel, held)] if held else []

    def _candidates(self) -> list[tuple[str, str]]:
        """(marker, channel it leads to) that can occur in the current channel."""
        if self._channel == CONTENT:
            return [(pair[0], channel) for channel, pair in self._markers.items()]
        close = self._markers.get(self._channel)
        return [(close[1], CONTENT)] if close else []

    def _next_marker(self, buffer: str) -> tuple[int, str, str] | None:
        best: tuple[int, str, str] | None = None
        for marker, channel in self._candidates():
            index = self._find(buffer, marker)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, marker, channel)
        return best

    def _find(self, buffer: str, marker: str) -> int:
        """The marker's first offset in ``buffer``; in a JSON channel, outside strings."""
        if self._channel not in self._json_channels:
            return buffer.find(marker)
        strings = self._strings.copy()
        for i, ch in enumerate(buffer):
            if not strings.inside and buffer.startswith(marker, i):
                return i
            strings.step(ch)
        return -1

    def _partial_suffix(self, buffer: str) -> int:
        keep = partial_suffix(buffer, [marker for marker, _ in self._candidates()])
        if keep and self._channel in self._json_channels:
            strings = self._strings.copy()
            strings.advance(buffer[:len(buffer) - keep])
            return 0 if strings.inside else keep  # inside a string it cannot be a marker
        return keep
