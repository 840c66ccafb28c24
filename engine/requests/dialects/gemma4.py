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

from engine.requests.constraints.forced_calls import separated
from engine.requests.dialects.call_rules import calls_lark
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.schema_values import bare_value, enum_value, main_type
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

        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            head = json.dumps(f"call:{tool.name}")
            return f"{start} {head} {values.of(tool.parameters, rules)} {end}"
        return calls_lark(tools, choice, parallel, body)


class GemmaValues:
    """Lark for values in Gemma 4's literal syntax, by schema; nested values get rules,
    numbered across every call of one grammar."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self._count = 0

    def of(self, schema: Mapping[str, Any], rules: list[str]) -> str:
        """Lark for a value of ``schema``; the rules of its nested values go to ``rules``."""
        kind, _ = main_type(schema)
        enum = enum_value(schema, self.constant)
        if enum is not None:
            return enum
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, rules)
        if kind == "array":
            item = self._rule(self.of(schema.get("items") or {}, rules), rules)
            return f'"[" ({item} ("," {item})*)? "]"'
        # Strings, and what has no one type, between quote tokens.
        return bare_value(kind) or f"{self.quote} {_TEXT}? {self.quote}"

    def constant(self, value: Any) -> str:
        """Lark for one literal value, as the template's ``format_argument`` writes it."""
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else \
                f"{self.quote} {self.quote}"
        return json.dumps(json.dumps(value))  # numbers, true/false as JSON spells them

    def _object(self, schema: Mapping[str, Any], rules: list[str]) -> str:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        entries = [(f"{json.dumps(key + ':')} {self._rule(self.of(value, rules), rules)}",
                    key in required)
                   for key, value in sorted(properties.items())]  # dictsort
        return f'"{{" {separated(entries, json.dumps(","))} "}}"'

    def _rule(self, body: str, rules: list[str]) -> str:
        name = f"v_{self._count}"
        self._count += 1
        rules.append(f"{name}: {body}")
        return name
