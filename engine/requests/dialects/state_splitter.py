"""The frame of a family splitter that reads its output state by state.

Llama 3's answers, Mistral's and DeepSeek-R1's marked calls and gpt-oss's harmony messages
are each read by a small machine: in each state a reader takes the text not read yet,
appends the ``(channel, text)`` pieces it read and returns the rest, having set the next
state. ``StateSplitter`` runs the readers over each piece of text, holds back text that may
be the start of a marker until the next one arrives, and marks each change of channel with
an empty piece (what ``RowChannels`` reads as a switch). No mlx here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from engine.requests.dialects.scanning import partial_suffix
from engine.requests.outbound.channels import CONTENT

Pieces = list[tuple[str, str]]
# (text not read yet, the pieces so far) -> the text left for the next state's reader.
Reader = Callable[[str, Pieces], str]


class StateSplitter:
    """Runs one reader per state over the row's text; subclasses give the readers."""

    def __init__(self, readers: Mapping[str, Reader], state: str,
                 channel: str = CONTENT) -> None:
        self._readers = readers
        self._state = state
        self._channel = channel
        self._held = ""  # text that may be the start of a marker, read with the next feed

    @property
    def channel(self) -> str:
        return self._channel

    def feed(self, text: str) -> Pieces:
        pieces: Pieces = []
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._readers[self._state](buffer, pieces)
        return pieces

    def _emit_holding(self, buffer: str, markers: Sequence[str], pieces: Pieces) -> str:
        """``buffer`` into the current channel but for a tail that may start one of
        ``markers``, held for the next feed; nothing is left to read."""
        keep = partial_suffix(buffer, markers)
        if len(buffer) > keep:
            pieces.append((self._channel, buffer[:len(buffer) - keep]))
        self._held = buffer[len(buffer) - keep:]
        return ""

    def _switch(self, channel: str, pieces: Pieces) -> None:
        if channel != self._channel:
            self._channel = channel
            pieces.append((channel, ""))
