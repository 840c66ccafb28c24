"""Split a row's streamed text into channels: content, reasoning, tool-call markup.

Markers (``<think>``/``</think>``, ``<tool_call>``/``</tool_call>``) are matched on text,
so they may arrive split across tokens; a suffix that could be the start of a marker
is held back until it is known. Markers themselves are never emitted.
"""

from __future__ import annotations

import json

from engine.requests.tool_formats import split_call_list
from engine.requests.tools import (
    InvalidToolCall,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolSpec,
    call_deltas,
    new_call_id,
    parse_call,
)

CONTENT = "content"
REASONING = "reasoning"
TOOL = "tool"


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
        best = 0
        for marker, _ in self._candidates():
            for n in range(min(len(marker) - 1, len(buffer)), best, -1):
                if buffer.endswith(marker[:n]):
                    best = n
                    break
        return best


class RowChannels:
    """One row's text sorted into content, reasoning and tool calls as it streams.

    A call is parsed the moment its closing marker arrives. A call identical to one the
    row already made (same name, same arguments as parsed JSON) is not kept: it counts in
    ``repeated_calls``, which ``engine.core.update`` reads to end the row there. With
    parallel calls off, calls after the first are not kept either (``extra_calls``). Whitespace
    around calls is not an answer: whitespace-only content before the first call, between
    calls and after the last one is held back and dropped (released if text follows).

    A kept call becomes ``ToolCallDelta``s the moment it is kept (``take_deltas``): a call is
    only known to be kept once its closing marker has arrived and it parsed and is no
    repeat; before that, max_tokens, a stop or a parse error can still make it invalid, and
    no client protocol can take back a call it was sent.
    """

    def __init__(self, splitter: ChannelSplitter, parser: ToolParser | None,
                 tools: tuple[ToolSpec, ...], parallel: bool = True) -> None:
        self._splitter = splitter
        self._parser = parser
        self._tools = tools
        self._parallel = parallel  # False: only the first call is kept (parallel_tool_calls)
        self.content = ""
        self.reasoning = ""
        self.saw_reasoning = splitter.channel == REASONING
        self.saw_call = False  # call markup was seen (a call parsed, invalid or left open)
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []
        self.repeated_calls = 0  # calls dropped because the row had made them already
        self.extra_calls = 0  # calls dropped after the first when parallel calls are off
        self._call_text: str | None = None
        self._keys: set[str] = set()
        self._loose = True  # no answer text yet since the start or the last call
        self._spaces = ""  # whitespace content held back while loose
        self._deltas: list[ToolCallDelta] = []  # kept calls not yet taken by an event

    def feed(self, text: str) -> tuple[str, str]:
        """New text -> (content delta, reasoning delta); tool markup is collected apart."""
        return self._route(self._splitter.feed(text) if text else [])

    def finish(self) -> tuple[str, str]:
        """Flush held text; a call left open (cut by max_tokens) is reported invalid."""
        content, reasoning = self._route(self._splitter.flush())
        if self._call_text is not None:
            self.invalid.append(InvalidToolCall(new_call_id(), None, self._call_text,
                                                "the tool call was not closed"))
            self._call_text = None
        spaces, self._spaces = self._spaces, ""
        if spaces and not self.saw_call:  # a plain answer keeps its whitespace as written
            self.content += spaces
            content += spaces
        return content, reasoning

    def _route(self, pieces: list[tuple[str, str]]) -> tuple[str, str]:
        content = reasoning = ""
        for channel, text in pieces:
            if channel == TOOL:
                if self._call_text is None:  # a call opens: the whitespace before it goes
                    self._call_text, self._spaces, self.saw_call = "", "", True
                self._call_text += text
                continue
            self._close_call()
            if channel == REASONING:
                reasoning += text
                self.saw_reasoning = True
            else:
                content += self._answer_text(text)
        self.content += content
        self.reasoning += reasoning
        return content, reasoning

    def _answer_text(self, text: str) -> str:
        """Content to emit now; whitespace after the start or a call waits for text."""
        if not self._loose:
            return text
        if not text.strip():
            self._spaces += text
            return ""
        out, self._spaces, self._loose = self._spaces + text, "", False
        return out

    def _close_call(self) -> None:
        if self._call_text is None:
            return
        raw, self._call_text = self._call_text, None
        self._loose = True
        # A JSON list of calls in one block (SmolLM2's format) is one call per element.
        bodies = split_call_list(raw) if self._parser is None else None
        for body in [raw] if bodies is None else bodies:
            self._add_call(parse_call(body, self._parser, self._tools))

    def _add_call(self, parsed: ToolCall | InvalidToolCall) -> None:
        if isinstance(parsed, InvalidToolCall):
            self.invalid.append(parsed)
            return
        key = call_key(parsed)
        if key in self._keys:
            self.repeated_calls += 1
            return
        if self.calls and not self._parallel:  # a model may ignore the prompt's one-call rule
            self.extra_calls += 1
            return
        self._keys.add(key)
        self._deltas += call_deltas(len(self.calls), parsed)
        self.calls.append(parsed)

    def take_deltas(self) -> tuple[ToolCallDelta, ...]:
        """Deltas of the calls kept since the last take (each call streams exactly once)."""
        deltas, self._deltas = tuple(self._deltas), []
        return deltas


def call_key(call: ToolCall) -> str:
    """Identity of a call for spotting repeats: its name and its arguments as parsed JSON."""
    return json.dumps([call.name, call.arguments], sort_keys=True, ensure_ascii=False,
                      default=repr)
