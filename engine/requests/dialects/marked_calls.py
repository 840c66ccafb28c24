# ruff: noqa: RUF002  (DeepSeek's tokens are spelled with fullwidth bars, as quoted here)
"""Calls written as a marker, a header naming the tool, and a JSON arguments object.

Mistral writes ``[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}``;
DeepSeek-R1 writes ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n
{"city": "Paris"}\\n```<｜tool▁call▁end｜>``. ``CallSyntax`` describes one such family;
``MarkedCallSplitter`` reads its output: the header is read whole and never emitted, the
arguments stream inside a JSON call object ``{"name": "get_weather", "arguments": ...}``
that the splitter writes around them, so ``RowChannels`` sends them as fragments as the
model writes them. Each call is its own tool block (a switch to content closes it). No mlx.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.requests.dialects.scanning import JsonEnd, first_marker, partial_suffix
from engine.requests.dialects.state_splitter import StateSplitter
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL


@dataclass(frozen=True)
class CallSyntax:
    """One family's marked calls: ``open``, a header, ``args``, a JSON object, then (when
    ``close`` is set) text up to ``close`` that is markup, never content."""

    open: str
    args: str
    name_of: Callable[[str], str | None]  # the header (between ``open`` and ``args``) -> name
    close: str = ""
    dropped: tuple[str, ...] = ()  # markers around the calls, read and never emitted
    json_list: bool = False  # a header that starts with "[" or "{" is JSON call objects


class MarkedCallSplitter(StateSplitter):
    """A row's text into content, reasoning (between the ``reasoning`` markers) and calls
    written in a ``CallSyntax``."""

    def __init__(self, syntax: CallSyntax, reasoning: tuple[str, str] | None,
                 start: str = CONTENT) -> None:
        super().__init__({"text": self._text, "header": self._read_header, "args": self._args,
                          "tail": self._tail}, "text", start)
        self._syntax = syntax
        self._reasoning = reasoning if reasoning and all(reasoning) else None
        self._header = ""
        self._json = JsonEnd()
        self._wrapped = False  # the arguments sit in a call object this splitter opened

    def flush(self) -> list[tuple[str, str]]:
        """The row ended (its end-of-turn token is never text). A call's header left
        unfinished is handed over as it is, an invalid call; a call whose arguments were
        cut closes its block, so it is reported invalid."""
        pieces: list[tuple[str, str]] = []
        held, self._held = self._held, ""
        if self._state == "text" and held:
            pieces.append((self._channel, held))
        elif self._state == "header":
            self._switch(TOOL, pieces)
            pieces.append((TOOL, self._header + held))
        self._header, self._state = "", "text"
        if self._channel == TOOL:
            self._switch(CONTENT, pieces)
        return pieces

    # ----- states: each reads from the buffer and returns what it left ----------------------

    def _text(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        markers = self._text_markers()
        index, marker = first_marker(buffer, markers)
        if index < 0:
            return self._emit_holding(buffer, markers, pieces)
        if index:
            pieces.append((self._channel, buffer[:index]))
        if self._channel == REASONING:
            self._switch(CONTENT, pieces)
        elif self._reasoning is not None and marker == self._reasoning[0]:
            self._switch(REASONING, pieces)
        elif marker == self._syntax.open:
            self._state, self._header = "header", ""
        return buffer[index + len(marker):]  # a dropped marker: read, never emitted

    def _read_header(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        header = self._header + buffer
        syntax = self._syntax
        if syntax.json_list and header.lstrip()[:1] in ("[", "{"):
            # JSON call objects right after the marker: handed over as they are.
            self._open_args(pieces, None)
            self._header = ""
            return header
        index = header.find(syntax.args)
        if index < 0:
            self._header = header
            return ""
        self._header = ""
        name = syntax.name_of(header[:index])
        self._open_args(pieces, name)
        if name is None:  # not a header of this syntax: the block is an invalid call
            pieces.append((TOOL, header[:index + len(syntax.args)]))
        return header[index + len(syntax.args):]

    def _open_args(self, pieces: list[tuple[str, str]], name: str | None) -> None:
        self._switch(TOOL, pieces)
        self._json, self._state, self._wrapped = JsonEnd(), "args", name is not None
        if name is not None:
            pieces.append((TOOL, f'{{"name": {json.dumps(name)}, "arguments": '))

    def _args(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        end = self._json.feed(buffer)
        if end < 0:
            pieces.append((TOOL, buffer))
            return ""
        pieces.append((TOOL, buffer[:end] + ("}" if self._wrapped else "")))
        self._switch(CONTENT, pieces)
        self._state = "tail" if self._syntax.close else "text"
        return buffer[end:]

    def _tail(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        index = buffer.find(self._syntax.close)
        if index < 0:
            keep = partial_suffix(buffer, [self._syntax.close])
            self._held = buffer[len(buffer) - keep:] if keep else ""
            return ""
        self._state = "text"
        return buffer[index + len(self._syntax.close):]

    def _text_markers(self) -> list[str]:
        if self._channel == REASONING:
            return [self._reasoning[1]] if self._reasoning else []
        opens = [self._reasoning[0]] if self._reasoning else []
        return [*opens, self._syntax.open, *self._syntax.dropped]
