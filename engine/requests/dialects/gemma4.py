"""Gemma 4's dialect: ``call:`` tool calls, the ``thought`` channel for reasoning.

Gemma 4's template writes each call in its own block, arguments in its own literal
syntax, keys sorted and unquoted, strings between ``<|"|>`` tokens::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

and its reasoning as ``<|channel>thought\\n...<channel|>``. mlx-lm infers both pairs of
markers and its ``gemma4`` parser, which reads a closed block (so calls arrive whole, not
streamed). A forced call is written in that syntax, each value constrained by its schema.
With thinking off the template closes an empty thought channel in the prompt, with it on
the model opens the channel itself: a prompt never ends inside reasoning. No mlx here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.requests.constraints.forced_calls import (
    BOUNDED_INTEGER,
    BOUNDED_NUMBER,
    chosen_tools,
    separated,
)
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.xml_calls import main_type
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import TOOL

QUOTE = '<|"|>'
# A string's text stops at "<", so it can never write the bytes of a quote token.
_TEXT = "/[^<]+/"


class Gemma4(Dialect):
    """Gemma 4 (mlx-lm's ``gemma4`` parser)."""

    name = "gemma4"
    priority = 30
    reasoning_tokens = (("<|channel>", "<channel|>"),)  # its thought channel's tokens
    json_arguments = False  # its values are written in Gemma's literal syntax, by property

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        return facts.parser_name == "gemma4"

    @property
    def reasoning_close(self) -> None:
        return None  # the prompt never leaves the thought channel open

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """``calls``: one block (several, back to back, when ``parallel``)."""
        start, end = (literal(marker) for marker in self.markers[TOOL])
        values = GemmaValues(literal(QUOTE))
        names = []
        for i, tool in enumerate(chosen_tools(tools, choice)):
            names.append(f"call_{i}")
            head = json.dumps(f"call:{tool.name}")
            values.rules.append(f"call_{i}: {start} {head} {values.of(tool.parameters)} {end}")
        repeat = "+" if parallel else ""
        return "\n".join([f"calls: call{repeat}", f"call: {' | '.join(names)}",
                          *values.rules]) + "\n"


class GemmaValues:
    """Lark for values in Gemma 4's literal syntax, by schema; nested values get rules."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.rules: list[str] = []

    def of(self, schema: Mapping[str, Any]) -> str:
        kind, _ = main_type(schema)
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(self.constant(v) for v in schema["enum"]) + ")"
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema)
        if kind == "array":
            item = self._rule(self.of(schema.get("items") or {}))
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "integer":
            return BOUNDED_INTEGER
        if kind == "number":
            return BOUNDED_NUMBER
        if kind == "boolean":
            return '("true" | "false")'
        return f"{self.quote} {_TEXT}? {self.quote}"  # strings, and what has no one type

    def constant(self, value: Any) -> str:
        """Lark for one literal value, as the template's ``format_argument`` writes it."""
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else \
                f"{self.quote} {self.quote}"
        return json.dumps(json.dumps(value))  # numbers, true/false as JSON spells them

    def _object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        entries = [(f"{json.dumps(key + ':')} {self._rule(self.of(properties[key]))}",
                    key in required) for key in sorted(properties)]  # dictsort
        return f'"{{" {separated(entries, json.dumps(","))} "}}"'

    def _rule(self, body: str) -> str:
        name = f"v_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name
