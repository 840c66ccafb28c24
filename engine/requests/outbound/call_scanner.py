"""JSON tool calls read character by character as they stream.

``CallScanner`` reads a tool block's text as it arrives as JSON call objects (one, or a
JSON list of them): the open call's name once its string is whole, its arguments
object's text as it grows, each object's text when it closes. ``compact_json`` is the
comparison form the hold-back policy uses. No mlx.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.requests.outbound.tool_calls import ToolParser, new_call_id


class CallElement:
    """One call object of a tool block as it streams."""

    def __init__(self, start: int, call_id: str) -> None:
        self.start = start  # offset of its "{" in the block's text
        self.id = call_id
        self.name: str | None = None
        self.args = ""  # the arguments object's text so far, as the model writes it
        self.args_key: str | None = None  # "arguments" or "parameters", the one captured
        self.args_done = False
        self.keys: list[str] = []  # the object's keys, in order
        self.text = ""  # the whole object's text, once it closed
        self.index: int | None = None  # set when its first delta goes out
        self.sent = 0  # characters of its arguments text sent

    @property
    def used_key(self) -> str | None:
        """The key ``parse_call`` reads the arguments from."""
        for key in ("arguments", "parameters"):
            if key in self.keys:
                return key
        return None


_SPACE = " \t\r\n"


class CallScanner:
    """A tool block's text read as it arrives as JSON call objects: one object, or a JSON
    list of them. Tracks the open object's name (once its string is whole) and its
    arguments object's text as it grows; hands each object's text over when it closes.
    ``failed`` once the text cannot be such JSON (the rest is then not read)."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id  # call ids as the model's chat template accepts them
        self.text = ""
        self.pos = 0
        self.failed = False
        self.element: CallElement | None = None  # the object being written
        self.end = 0  # offset after the last closed object
        self.closed = 0  # objects closed so far
        self._closed: list[tuple[CallElement, str]] = []
        self._state = "start"
        self._list = False
        self._token = ""  # a key or a name string being read
        self._key = ""
        self._escape = False
        self._depth = 0
        self._in_string = False
        self._capture = False

    def feed(self, text: str) -> None:
        self.text += text
        while self.pos < len(self.text) and not self.failed:
            self._step(self.text[self.pos])
            self.pos += 1

    def take_closed(self) -> list[tuple[CallElement, str]]:
        closed, self._closed = self._closed, []
        return closed

    def _fail(self) -> None:
        self.failed = True

    def _string_char(self, ch: str) -> bool:
        """One character of a string being read; True when it closed the string."""
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            return True
        return False

    def _step(self, ch: str) -> None:
        state = self._state
        if state in ("start", "item", "sep", "after", "key_or_close", "colon",
                     "comma_or_close", "key", "value") and ch in _SPACE:
            return
        if state == "start":
            if ch == "[":
                self._list, self._state = True, "item"
            elif ch == "{":
                self._open()
            else:
                self._fail()
        elif state == "item":
            if ch == "{":
                self._open()
            elif ch == "]":
                self._state = "after"
            else:
                self._fail()
        elif state == "sep":
            if ch == ",":
                self._state = "item"
            elif ch == "]":
                self._state = "after"
            else:
                self._fail()
        elif state == "after":
            self._fail()
        elif state in ("key_or_close", "key"):
            if ch == '"':
                self._token, self._state = ch, "key_text"
            elif ch == "}" and state == "key_or_close":
                self._close()
            else:
                self._fail()
        elif state == "key_text":
            self._token += ch
            if self._string_char(ch):
                self._key = json.loads(self._token)
                assert self.element is not None
                self.element.keys.append(self._key)
                self._state = "colon"
        elif state == "colon":
            if ch == ":":
                self._state = "value"
            else:
                self._fail()
        elif state == "value":
            self._value(ch)
        elif state == "name":
            self._token += ch
            if self._string_char(ch):
                assert self.element is not None
                self.element.name = json.loads(self._token)
                self._state = "comma_or_close"
        elif state == "string":
            if self._string_char(ch):
                self._state = "comma_or_close"
        elif state == "nested":
            self._nested(ch)
        elif state == "scalar":
            if ch in _SPACE:
                self._state = "comma_or_close"
            elif ch == ",":
                self._state = "key"
            elif ch == "}":
                self._close()
        elif state == "comma_or_close":
            if ch == ",":
                self._state = "key"
            elif ch == "}":
                self._close()
            else:
                self._fail()

    def _value(self, ch: str) -> None:
        element = self.element
        assert element is not None
        if self._key == "name" and ch == '"' and element.name is None:
            self._token, self._state = ch, "name"
        elif ch in "{[":
            self._capture = (ch == "{" and self._key in ("arguments", "parameters")
                             and element.args_key is None)
            if self._capture:
                element.args_key, element.args = self._key, ch
            self._depth, self._in_string, self._state = 1, False, "nested"
        elif ch == '"':
            self._escape, self._state = False, "string"
        elif ch in ",}]:":
            self._fail()
        else:
            self._state = "scalar"

    def _nested(self, ch: str) -> None:
        element = self.element
        assert element is not None
        if self._capture:
            element.args += ch
        if self._in_string:
            self._in_string = not self._string_char(ch)
            return
        if ch == '"':
            self._in_string, self._escape = True, False
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                element.args_done = element.args_done or self._capture
                self._capture, self._state = False, "comma_or_close"

    def _open(self) -> None:
        self.element, self._state = CallElement(self.pos, self._new_id()), "key_or_close"

    def _close(self) -> None:
        element = self.element
        assert element is not None
        element.text = self.text[element.start:self.pos + 1]
        self._closed.append((element, element.text))
        self.element, self.end, self.closed = None, self.pos + 1, self.closed + 1
        self._state = "sep" if self._list else "after"


def reads_json(parser: ToolParser | None) -> bool:
    """Whether calls are the JSON objects ``CallScanner`` reads as they stream: no model
    parser (the tagged-JSON fallback, SmolLM2's list), or mlx-lm's ``json_tools`` parser
    (Qwen and the Hermes-style families), which is ``json.loads`` of the same text."""
    return parser is None or getattr(parser, "__module__", "").endswith(
        "tool_parsers.json_tools")


def compact_json(text: str) -> str:
    """JSON text (whole or a prefix) without the whitespace outside its strings."""
    out: list[str] = []
    in_string = escape = False
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _SPACE:
            continue
        out.append(ch)
    return "".join(out)
