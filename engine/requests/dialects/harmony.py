"""gpt-oss's harmony format: messages in channels, tool calls as messages to a recipient.

After the prompt's ``<|start|>assistant`` the model writes messages, each a header and a
body::

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>            (one line, broken here)

The header names the channel and, for a call, its recipient (``to=functions.NAME``, before
or after the channel; on the analysis channel too, which gpt-oss does). ``analysis`` is
reasoning; ``final`` and recipient-less ``commentary`` (a preamble) are the answer; a
message to ``functions.NAME`` is a call, handed over as the JSON call object
``{"name": "NAME", "arguments": <its body>}`` so its arguments stream as they are written.
No header text ever reaches content. ``<|call|>`` ends the turn (a stop token), so a turn
holds one call, as the chat template renders one. No mlx here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from engine.requests.constraints.forced_calls import arguments_schema, chosen_tools
from engine.requests.dialects.dialect import Dialect, Literal, ReasoningMarks, TokenizerFacts
from engine.requests.dialects.scanning import first_marker, partial_suffix
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL, Splitter

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_FUNCTIONS = "functions."


class Harmony(Dialect):
    """gpt-oss (``openai/gpt-oss-*``)."""

    name = "harmony"
    priority = 70  # its channel tokens are checked before any other family's marks
    reasoning_tokens = ((CHANNEL, MESSAGE),)  # the analysis channel is its reasoning
    writes_json_calls = True

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        return all(token in facts.vocab for token in (CHANNEL, MESSAGE, CALL, START))

    @property
    def reasoning_close(self) -> None:
        return None  # the prompt never opens a message: the model writes every header

    @property
    def model_reasoning(self) -> ReasoningMarks:
        """An analysis message, then the next message's start (its channel follows)."""
        return ReasoningMarks(f"{CHANNEL}analysis{MESSAGE}", END, f"{START}assistant")

    # The answer is a message on the final channel; <|return|> (end of sequence) ends it.
    answer_head = f"{CHANNEL}final{MESSAGE}"

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        return HarmonySplitter()

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """One call (``<|call|>`` ends the turn, whatever ``parallel`` says), written as
        gpt-oss writes it: to the commentary channel, JSON constrained."""
        head = f'{literal(CHANNEL)} "commentary to={_FUNCTIONS}"'
        mid = f'" " {literal(CONSTRAIN)} "json" {literal(MESSAGE)}'
        lines, names = [], []
        for i, tool in enumerate(chosen_tools(tools, choice)):
            names.append(f"call_{i}")
            lines.append(f"call_{i}: {head} {json.dumps(tool.name)} {mid} args_{i} "
                         f"{literal(CALL)}")
            lines.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
        return "\n".join([f"calls: {' | '.join(names)}", *lines]) + "\n"


class HarmonySplitter:
    """Harmony messages into channels: headers are read whole and never emitted; bodies
    stream to their channel; a call's body streams inside its JSON call object."""

    def __init__(self) -> None:
        self._channel = CONTENT
        self._in_body = False
        self._header = ""
        self._held = ""  # body text that may be the start of an end marker
        self._calling = False  # the open body is a call's arguments

    @property
    def channel(self) -> str:
        return self._channel

    def feed(self, text: str) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        buffer = self._held + text
        self._held = ""
        while buffer:
            if not self._in_body:
                buffer = self._read_header(buffer, pieces)
                continue
            index, marker = first_marker(buffer, _BODY_ENDS)
            if index < 0:
                keep = partial_suffix(buffer, _BODY_ENDS)
                body, self._held = buffer[:len(buffer) - keep], buffer[len(buffer) - keep:]
                if body:
                    pieces.append((self._channel, body))
                break
            if index:
                pieces.append((self._channel, buffer[:index]))
            self._end_body(pieces)
            buffer = buffer[index + len(marker):]
        return pieces

    def flush(self) -> list[tuple[str, str]]:
        """The row ended. ``<|call|>`` and ``<|return|>`` are stop tokens, never text: the
        open body ends here, a call's object closes (cut short, its JSON stays incomplete:
        an invalid call). An unfinished header is dropped."""
        held, self._held = self._held, ""
        pieces = [(self._channel, held)] if held and self._in_body else []
        if self._in_body:
            self._end_body(pieces)
        self._header = ""
        return pieces

    def _read_header(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        """Header text up to ``<|message|>``: held until it is whole, then its body opens."""
        self._header += buffer
        index = self._header.find(MESSAGE)
        if index < 0:
            return ""
        header, rest = self._header[:index], self._header[index + len(MESSAGE):]
        self._header = ""
        self._open_body(header, pieces)
        return rest

    def _open_body(self, header: str, pieces: list[tuple[str, str]]) -> None:
        self._in_body = True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel else ""
        if recipient is not None and recipient.group(1) != "assistant":
            target = recipient.group(1)
            target = target[len(_FUNCTIONS):] if target.startswith(_FUNCTIONS) else target
            self._switch(TOOL, pieces)
            pieces.append((TOOL, f'{{"name": {json.dumps(target)}, "arguments": '))
            self._calling = True
        else:
            self._switch(REASONING if name == "analysis" else CONTENT, pieces)

    def _end_body(self, pieces: list[tuple[str, str]]) -> None:
        if self._calling:
            pieces.append((TOOL, "}"))
            self._calling = False
        self._in_body = False
        self._switch(CONTENT, pieces)

    def _switch(self, channel: str, pieces: list[tuple[str, str]]) -> None:
        if channel != self._channel:
            self._channel = channel
            pieces.append((channel, ""))


