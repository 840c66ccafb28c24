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

from engine.requests.dialects.call_rules import calls_lark, json_arguments
from engine.requests.dialects.dialect import Dialect, Literal, ReasoningMarks, TokenizerFacts
from engine.requests.dialects.scanning import first_marker
from engine.requests.dialects.state_splitter import StateSplitter
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

        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            return (f"{head} {json.dumps(tool.name)} {mid} {json_arguments(i, tool, rules)} "
                    f"{literal(CALL)}")
        return calls_lark(tools, choice, False, body)


class HarmonySplitter(StateSplitter):
    """Harmony messages into channels: headers are read whole and never emitted; bodies
    stream to their channel; a call's body streams inside its JSON call object."""

    def __init__(self) -> None:
        super().__init__({"header": self._read_header, "body": self._read_body}, "header")
        self._header = ""
        self._calling = False  # the open body is a call's arguments

    def flush(self) -> list[tuple[str, str]]:
        """The row ended. ``<|call|>`` and ``<|return|>`` are stop tokens, never text: the
        open body ends here, a call's object closes (cut short, its JSON stays incomplete:
        an invalid call). An unfinished header is dropped."""
        held, self._held = self._held, ""
        in_body = self._state == "body"
        pieces = [(self._channel, held)] if held and in_body else []
        if in_body:
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

    def _read_body(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        """Body text to its channel up to an end marker (a tail that may start one held)."""
        index, marker = first_marker(buffer, _BODY_ENDS)
        if index < 0:
            return self._emit_holding(buffer, _BODY_ENDS, pieces)
        if index:
            pieces.append((self._channel, buffer[:index]))
        self._end_body(pieces)
        return buffer[index + len(marker):]

    def _open_body(self, header: str, pieces: list[tuple[str, str]]) -> None:
        self._state = "body"
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
        self._state = "header"
        self._switch(CONTENT, pieces)


