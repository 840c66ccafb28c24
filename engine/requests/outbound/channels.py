"""Split a row's streamed text into channels: content, reasoning, tool-call markup.

Markers (``<think>``/``</think>``, ``<tool_call>``/``</tool_call>``) are matched on text,
so they may arrive split across tokens; a suffix that could be the start of a marker
is held back until it is known. Markers themselves are never emitted.
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


class ChannelSplitter:
    """Feeds text, returns (channel, text) pieces; ``markers`` maps channel -> (open, close)."""

    def __init__(self, markers: dict[str, tuple[str, str]], start: str = CONTENT) -> None:
        self._markers = {channel: pair for channel, pair in markers.items() if all(pair)}
        self._channel = start
        self._held = ""

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
                self._held = buffer[len(buffer) - keep :]
                break
            index, marker, next_channel = found
            if index:
                pieces.append((self._channel, buffer[:index]))
            self._channel = next_channel
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
            index = buffer.find(marker)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, marker, channel)
        return best

    def _partial_suffix(self, buffer: str) -> int:
        return partial_suffix(buffer, [marker for marker, _ in self._candidates()])
