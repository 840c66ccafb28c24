"""Qwen3.5's and Qwen3-Coder's dialect: XML tool calls, ``<think>`` reasoning.

Their templates (and mlx-lm, which infers its ``qwen3_coder`` parser for them) write::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

one block per call, a newline between blocks. Calls are read by ``XmlCallWriter`` into JSON
call objects as they stream (string values stream as they are written). A forced call is
written in that XML, each value constrained by its schema: strings on one line without
``<`` (an enum is one of its values), numbers, ``true``/``false``, JSON for objects and
arrays. Qwen3.5's prompt opens ``<think>``: a forced call closes it first (the base
dialect's ``reasoning_close``). No mlx here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.requests.constraints.forced_calls import compact_schema
from engine.requests.dialects.call_blocks import CallBlockSplitter
from engine.requests.dialects.call_rules import calls_lark
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.schema_values import bare_value, enum_value, main_type
from engine.requests.dialects.xml_calls import XmlCallWriter
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, TOOL, Splitter

# Forced values end: a string is one line without "<" (its lexeme must not run into the
# closing tag); numbers have at most 16 digits a part, so a forced value always ends.
_ONE_LINE = "/[^<\\n]+/"


class QwenXml(Dialect):
    """Qwen3.5, Qwen3-Coder (mlx-lm's ``qwen3_coder`` parser)."""

    name = "qwen-xml"
    priority = 40
    writes_json_calls = True  # blocks are rewritten into JSON call objects as they stream
    json_arguments = False  # its parameters are XML elements, property by property

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        return facts.parser_name == "qwen3_coder"

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        return CallBlockSplitter(self.markers, start, lambda: XmlCallWriter(tools))

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """``calls``: one XML call block (several, a newline apart, when ``parallel``)."""
        start, end = (literal(marker) for marker in self.markers[TOOL])

        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            head = json.dumps(f"\n<function={tool.name}>\n")
            params = _parameters(tool, f"p{i}", rules)
            return f'{start} {head} {params} "</function>\\n" {end}'
        return calls_lark(tools, choice, parallel, body, between='"\\n"')


def _parameters(tool: ToolSpec, prefix: str, lines: list[str]) -> str:
    """The Lark sequence of a tool's parameters in schema order (optional ones optional);
    their rules are appended to ``lines``."""
    properties = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    parts = []
    for j, (name, schema) in enumerate(properties.items()):
        rule = f"{prefix}_{j}"
        tag = json.dumps(f"<parameter={name}>\n")
        lines.append(f'{rule}: {tag} {xml_value(schema)} "\\n</parameter>\\n"')
        parts.append(rule if name in required else f"{rule}?")
    return " ".join(parts) if parts else '""'


def xml_value(schema: Mapping[str, Any]) -> str:
    """Lark for one parameter's value as Qwen's template writes it (raw, not JSON quoted)."""
    kind, _ = main_type(schema)
    enum = enum_value(schema, _raw_constant)
    if enum is not None:
        return enum
    if kind == "string" or not schema:
        return _ONE_LINE
    # Objects, arrays and what has no one type are JSON.
    return bare_value(kind) or f"%json {json.dumps(compact_schema(dict(schema)))}"


def _raw_constant(value: Any) -> str:
    """Lark for an enum value as the template writes it: a string raw, others as JSON."""
    return json.dumps(value if isinstance(value, str) else json.dumps(value))
