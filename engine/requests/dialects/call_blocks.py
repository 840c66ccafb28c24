"""Tool-call blocks rewritten as JSON call objects as they stream.

Families whose calls are not JSON (Qwen3.5's XML, LFM2's Python calls) still have their
calls between a pair of markers, so ``ChannelSplitter`` finds the blocks; a ``CallWriter``
then rewrites each block's text into the JSON call objects ``RowChannels`` reads as they
arrive (``{"name": ..., "arguments": {...}}``, alone or as a list). A writer that can
translate as it reads makes the arguments stream; one that needs the whole block writes
it at the close. No mlx here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.requests.outbound.channels import TOOL, ChannelSplitter


class CallWriter(Protocol):
    """One tool block's text in, JSON call text out."""

    def feed(self, text: str) -> str:
        """More of the block's text; the JSON that can be written now."""

    def close(self, complete: bool) -> str:
        """The block ended: at its end marker (``complete``), or cut by the end of the row
        (the JSON is then left unfinished, so the call is reported invalid)."""


class CallBlockSplitter:
    """``ChannelSplitter`` whose tool blocks go through a fresh ``CallWriter`` each."""

    def __init__(self, markers: dict[str, tuple[str, str]], start: str,
                 writer: Callable[[], CallWriter]) -> None:
        self._inner = ChannelSplitter(markers, start)
        self._new_writer = writer
        self._writer: CallWriter | None = None

    @property
    def channel(self) -> str:
        return self._inner.channel

    def feed(self, text: str) -> list[tuple[str, str]]:
        return self._rewrite(self._inner.feed(text))

    def flush(self) -> list[tuple[str, str]]:
        pieces = self._rewrite(self._inner.flush())
        if self._writer is not None:  # the row ended inside a block
            tail, self._writer = self._writer.close(False), None
            if tail:
                pieces.append((TOOL, tail))
        return pieces

    def _rewrite(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for channel, text in pieces:
            if channel != TOOL:
                if self._writer is not None:  # the block's end marker was read
                    tail, self._writer = self._writer.close(True), None
                    if tail:
                        out.append((TOOL, tail))
                out.append((channel, text))
                continue
            if self._writer is None:
                self._writer = self._new_writer()
                out.append((TOOL, ""))  # the switch, before any JSON
            written = self._writer.feed(text) if text else ""
            if written:
                out.append((TOOL, written))
        return out
