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

from engine.requests.constraints.forced_calls import (
    BOUNDED_INTEGER,
    BOUNDED_NUMBER,
    chosen_tools,
    compact_schema,
)
from engine.requests.dialects.call_blocks import CallBlockSplitter
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.xml_calls import XmlCallWriter, main_type
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
        names: list[str] = []
        lines: list[str] = []
        for i, tool in enumerate(chosen_tools(tools, choice)):
            names.append(f"call_{i}")
            head = json.dumps(f"\n<function={tool.name}>\n")
            params = _parameters(tool, f"p{i}", lines)
            lines.append(f'call_{i}: {start} {head} {params} "</function>\\n" {end}')
        repeat = ' ("\\n" call)*' if parallel else ""
        return "\n".join([f"calls: call{repeat}", f"call: {' | '.join(names)}",
                          *lines]) + "\n"


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
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = [v if isinstance(v, str) else json.dumps(v) for v in schema["enum"]]
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    if kind == "string" or not schema:
        return _ONE_LINE
    if kind == "integer":
        return BOUNDED_INTEGER
    if kind == "number":
        return BOUNDED_NUMBER
    if kind == "boolean":
        return '("true" | "false")'
    return f"%json {json.dumps(compact_schema(dict(schema)))}"
