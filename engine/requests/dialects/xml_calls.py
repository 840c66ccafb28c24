"""Qwen3.5's and Qwen3-Coder's XML call read as a JSON call object while it streams.

The block between ``<tool_call>`` and ``</tool_call>`` is::

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

and becomes ``{"name": "get_weather", "arguments": {"city": "Paris"}}``. A value is raw
text (one newline after the opening tag and one before the closing tag are layout); the
tool's schema says what it is, as Qwen's own parser reads it: a string-typed parameter
streams as a JSON string as it is written; any other is converted when its closing tag
arrives (numbers, booleans, JSON objects and arrays, ``null``). A value the schema
cannot read is written as it is, which is not JSON, so the call is reported invalid.
No mlx here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.requests.dialects.schema_values import main_type
from engine.requests.inbound.tool_specs import ToolSpec

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def property_schema(tools: Sequence[ToolSpec], tool: str, name: str) -> Mapping[str, Any]:
    """The schema of one parameter of one tool; {} when either is not declared."""
    for spec in tools:
        if spec.name == tool:
            properties = spec.parameters.get("properties") or {}
            found = properties.get(name) if isinstance(properties, Mapping) else None
            return found if isinstance(found, Mapping) else {}
    return {}


def streams_as_string(schema: Mapping[str, Any]) -> bool:
    """Whether a value is a plain string (or undeclared, which Qwen's parser keeps as text)."""
    kind, nullable = main_type(schema)
    return (kind == "string" and not nullable) or not schema


def typed_json(text: str, schema: Mapping[str, Any]) -> str:
    """A parameter's raw value as JSON text, typed by its schema; raises ValueError when
    the schema cannot read it."""
    kind, _ = main_type(schema)
    if text.strip().lower() == "null" and kind != "string":
        return "null"
    if kind == "string":
        return json.dumps(text, ensure_ascii=False)
    if kind == "boolean":
        word = text.strip().lower()
        if word not in ("true", "false"):
            raise ValueError(f"not a boolean: {text!r}")
        return word
    if kind in ("integer", "number"):
        value = json.loads(text.strip())
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"not a number: {text!r}")
        if kind == "integer":
            if value != int(value):
                raise ValueError(f"not an integer: {text!r}")
            value = int(value)
        return json.dumps(value)
    if kind in ("object", "array"):
        value = json.loads(text)
        if not isinstance(value, dict if kind == "object" else list):
            raise ValueError(f"not an {kind}: {text!r}")
        return json.dumps(value, ensure_ascii=False)
    try:  # no single type: JSON containers stay JSON, anything else is text
        value = json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(value if isinstance(value, dict | list) else text, ensure_ascii=False)


class XmlCallWriter:
    """One ``<tool_call>`` block's XML in, its JSON call object out as it streams."""

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self._tools = tools
        self._buffer = ""
        self._state = "function"  # function -> parameters <-> value -> done
        self._name = ""
        self._first = True  # no parameter written yet
        self._schema: Mapping[str, Any] = {}
        self._streaming = False  # the open value streams as a JSON string
        self._value = ""  # the open value's text so far (when it does not stream)
        self._fresh = True  # the open value has had no text yet (its layout newline)

    def feed(self, text: str) -> str:
        self._buffer += text
        out: list[str] = []
        progressed = True
        while progressed and self._buffer:
            progressed = getattr(self, f"_read_{self._state}")(out)
        return "".join(out)

    def close(self, complete: bool) -> str:
        # A complete block that never closed its function is left unfinished too: invalid.
        return ""

    def _read_function(self, out: list[str]) -> bool:
        start = self._buffer.find(FUNCTION)
        end = self._buffer.find(">", start) if start >= 0 else -1
        if end < 0:
            return False
        self._name = self._buffer[start + len(FUNCTION):end].strip()
        self._buffer = self._buffer[end + 1:]
        out.append(f'{{"name": {json.dumps(self._name)}, "arguments": {{')
        self._state = "parameters"
        return True

    def _read_parameters(self, out: list[str]) -> bool:
        opens, closes = self._buffer.find(PARAMETER), self._buffer.find(FUNCTION_END)
        if closes >= 0 and (opens < 0 or closes < opens):
            self._buffer = ""
            out.append("}}")
            self._state = "done"
            return False
        end = self._buffer.find(">", opens) if opens >= 0 else -1
        if end < 0:
            return False
        name = self._buffer[opens + len(PARAMETER):end].strip()
        self._buffer = self._buffer[end + 1:]
        out.append(("" if self._first else ", ") + f"{json.dumps(name)}: ")
        self._first = False
        self._schema = property_schema(self._tools, self._name, name)
        self._streaming = streams_as_string(self._schema)
        self._value, self._fresh = "", True
        if self._streaming:
            out.append('"')
        self._state = "value"
        return True

    def _read_value(self, out: list[str]) -> bool:
        if self._fresh:  # the buffer has text: the first may be the layout newline
            self._buffer = self._buffer.removeprefix("\n")
            self._fresh = False
        end = self._buffer.find(PARAMETER_END)
        if end < 0:
            keep = _held(self._buffer)
            ready, self._buffer = self._buffer[:len(self._buffer) - keep], \
                self._buffer[len(self._buffer) - keep:]
            self._write_value(ready, out)
            return False
        ready = self._buffer[:end].removesuffix("\n")
        self._buffer = self._buffer[end + len(PARAMETER_END):]
        self._write_value(ready, out)
        if self._streaming:
            out.append('"')
        else:
            try:
                out.append(typed_json(self._value, self._schema))
            except ValueError:
                out.append(self._value)  # not JSON: the call is invalid
        self._state = "parameters"
        return True

    def _read_done(self, out: list[str]) -> bool:
        self._buffer = ""  # layout after </function>
        return False

    def _write_value(self, text: str, out: list[str]) -> None:
        if self._streaming:
            if text:
                out.append(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value += text


def _held(text: str) -> int:
    """Characters at the end of a value that may be the start of its closing tag: a partial
    ``</parameter>``, with the layout newline before it."""
    keep = 0
    for n in range(min(len(PARAMETER_END) - 1, len(text)), 0, -1):
        if text.endswith(PARAMETER_END[:n]):
            keep = n
            break
    if text[:len(text) - keep].endswith("\n"):
        keep += 1
    return keep
