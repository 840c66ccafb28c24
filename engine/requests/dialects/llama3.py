"""Llama 3.1 / 3.2 / 3.3's calls: the whole answer is a JSON call object.

The chat template asks for ``{"name": function name, "parameters": dictionary of argument
name and its value}`` and renders a call turn as exactly that, ended by ``<|eot_id|>`` (a
stop token, never text); the model may also put ``<|python_tag|>`` first (its code-call
mode), and writes several calls separated by ``;``. There is no closing marker, so the
splitter decides at the start of the output whether it is a call (``{"name":`` or the tag)
and reads each call to the end of its JSON object. The template renders one call per
assistant message and raises on more, so a history's multi-call turn is split into
consecutive assistant turns. mlx-lm infers no parser for these templates. No mlx here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.requests.dialects.call_rules import calls_lark, json_arguments
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.scanning import JsonEnd
from engine.requests.dialects.state_splitter import StateSplitter
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, TOOL, Splitter

PYTHON_TAG = "<|python_tag|>"
_HEAD = '{"name":'  # a call object's start, whitespace aside
_SPACE = re.compile(r"\s+")


class Llama3(Dialect):
    """Llama 3.1 and later 3.x instruct models (their ``<|python_tag|>`` and the template's
    ``"parameters"`` call format)."""

    name = "llama3-json"
    priority = 10  # the last family checked: its marks are a token and template text
    reasoning_tokens = ()
    writes_json_calls = True  # calls are JSON objects, read as they stream

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        template = facts.chat_template
        return (PYTHON_TAG in facts.vocab and "<|start_header_id|>" in template
                and '"parameters": ' in template)

    @property
    def markers(self) -> dict[str, tuple[str, str]]:
        return {TOOL: (PYTHON_TAG, "")}

    @property
    def reasoning_close(self) -> None:
        return None

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        if not tools:  # an answer that starts '{"name":' is only a call when tools were given
            return super().splitter(start, tools)
        return Llama3Splitter()

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An assistant turn with several calls -> one turn per call (the template raises
        "This model only supports single tool-calls at once!" otherwise)."""
        out: list[dict[str, Any]] = []
        for message in messages:
            calls = message.get("tool_calls") or []
            if message.get("role") != "assistant" or len(calls) < 2:
                out.append(message)
                continue
            out.extend({**message, "content": message.get("content") if i == 0 else "",
                        "tool_calls": [call]} for i, call in enumerate(calls))
        return out

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """``{"name": "NAME", "parameters": {...}}`` as the template renders a call;
        parallel calls separated by ``; ``."""
        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            head = literal(f'{{"name": {json.dumps(tool.name)}, "parameters": ')
            return f'{head} {json_arguments(i, tool, rules)} "}}"'
        return calls_lark(tools, choice, parallel, body, between='"; "')


class Llama3Splitter(StateSplitter):
    """A Llama 3 answer into content and calls. The output is a call when it opens with a
    JSON object whose first key is ``name``, or with ``<|python_tag|>``; then each JSON object
    is one call (``;`` and whitespace between them are separators), and text that follows
    the calls is content. ``<|python_tag|>`` later in an answer starts calls too."""

    def __init__(self) -> None:
        super().__init__({"start": self._start, "content": self._content, "calls": self._calls,
                          "args": self._args}, "start")
        self._json = JsonEnd()

    def flush(self) -> list[tuple[str, str]]:
        """The row ended (``<|eot_id|>``, ``<|eom_id|>``: no closing marker): the open call
        ends here; cut inside its JSON, it is reported invalid."""
        pieces: list[tuple[str, str]] = []
        held, self._held = self._held, ""
        if held and self._state in ("start", "content"):
            pieces.append((CONTENT, held))
        self._state = "content"
        self._switch(CONTENT, pieces)
        return pieces

    def _start(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        """Held until it is known whether the answer opens with a call."""
        lead = buffer.lstrip()
        if lead.startswith(PYTHON_TAG):
            self._state = "calls"
            return lead[len(PYTHON_TAG):]
        compact = _SPACE.sub("", lead)
        if compact.startswith(_HEAD):
            self._state = "calls"
            return lead
        if PYTHON_TAG.startswith(lead) or _HEAD.startswith(compact):
            self._held = buffer  # still either way
            return ""
        self._state = "content"
        return buffer

    def _content(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        index = buffer.find(PYTHON_TAG)
        if index < 0:
            return self._emit_holding(buffer, [PYTHON_TAG], pieces)
        if index:
            pieces.append((CONTENT, buffer[:index]))
        self._state = "calls"
        return buffer[index + len(PYTHON_TAG):]

    def _calls(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        """Between calls: separators are read; a JSON object opens a call, other text is
        the answer (code after ``<|python_tag|>`` included: an invalid call)."""
        lead = buffer.lstrip(" \t\r\n;")
        if not lead:
            return ""
        if lead.startswith(PYTHON_TAG):
            return lead[len(PYTHON_TAG):]
        if PYTHON_TAG.startswith(lead):
            self._held = lead
            return ""
        if lead[0] == "{" or not self._had_call:
            self._switch(TOOL, pieces)
            self._json, self._state = JsonEnd(), "args"
            return lead
        self._state = "content"
        return lead

    @property
    def _had_call(self) -> bool:
        return self._json.started

    def _args(self, buffer: str, pieces: list[tuple[str, str]]) -> str:
        end = self._json.feed(buffer)
        if end < 0:
            pieces.append((TOOL, buffer))
            return ""
        pieces.append((TOOL, buffer[:end]))
        self._switch(CONTENT, pieces)
        self._state = "calls"
        return buffer[end:]
