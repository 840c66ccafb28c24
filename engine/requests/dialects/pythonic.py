"""LFM2's dialect: tool calls as a Python list of calls.

LFM2 writes its calls in the answer (its template renders no ``tool_calls``)::

    <|tool_call_start|>[get_weather(city="Paris"), get_time(zone="CET")]<|tool_call_end|>

mlx-lm infers its ``pythonic`` parser. A block is read whole at its close (a Python
expression cannot be read before it ends) and handed over as JSON call objects, so a
block of several calls is several calls. Argument values are Python literals, and JSON's
``true``/``false``/``null`` where templates render nested values as JSON. A forced call is
written in that syntax, each keyword argument's value JSON for its schema (which Python
reads as the same literal). No mlx here.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.requests.constraints.forced_calls import compact_schema, separated
from engine.requests.dialects.call_blocks import CallBlockSplitter
from engine.requests.dialects.call_rules import calls_lark
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, TOOL, Splitter

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
               "None": None}


class Pythonic(Dialect):
    """LFM2 (mlx-lm's ``pythonic`` parser)."""

    name = "pythonic"
    priority = 20
    writes_json_calls = True  # blocks are rewritten into JSON call objects at their close
    json_arguments = False  # its keyword arguments are written property by property

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        return facts.parser_name == "pythonic"

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        return CallBlockSplitter(self.markers, start, PythonCallWriter)

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """LFM2's template renders no ``tool_calls``: past calls are written into their
        assistant turn's content as the model writes them, so the next turn sees them."""
        if "tool_calls" in self.facts.chat_template:
            return messages  # a template that renders calls itself
        start, end = self.markers[TOOL]
        out: list[dict[str, Any]] = []
        for message in messages:
            calls = message.get("tool_calls")
            if calls:
                message = {key: value for key, value in message.items() if key != "tool_calls"}
                message["content"] = (message.get("content") or "") + start + python_call_list(
                    [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) + end
            out.append(message)
        return out

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """``calls``: one block holding one call (several, comma separated, when
        ``parallel``)."""
        start, end = (literal(marker) for marker in self.markers[TOOL])

        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            properties = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or ())
            entries = [(f"{json.dumps(key + '=')} %json {json.dumps(compact_schema(value))}",
                        key in required) for key, value in properties.items()]
            return f'{json.dumps(tool.name + "(")} {separated(entries, json.dumps(", "))} ")"'
        return calls_lark(tools, choice, parallel, body, between='", "',
                          around=(f'{start} "["', f'"]" {end}'))


class PythonCallWriter:
    """One block's Python call list, written as JSON call objects when it closes."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> str:
        self._text += text
        return ""

    def close(self, complete: bool) -> str:
        if not complete:
            return self._text  # cut: not JSON, so the call is reported invalid
        try:
            calls = python_calls(self._text)
        except (SyntaxError, ValueError):
            return self._text
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)


def python_call_list(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Past calls (name, arguments) as LFM2 writes them: ``[name(key=<JSON>, ...), ...]``,
    values as JSON (as its forced calls write them; Python reads both)."""
    return "[" + ", ".join(
        f"{name}(" + ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}"
                               for key, value in arguments.items()) + ")"
        for name, arguments in calls) + "]"


def python_calls(text: str) -> list[dict[str, Any]]:
    """``[f(a=1), g(b="x")]`` (or one call without the list) -> JSON call objects; raises
    ValueError or SyntaxError for anything else."""
    body = ast.parse(text.strip(), mode="eval").body
    nodes = body.elts if isinstance(body, ast.List) else [body]
    if not nodes:
        raise ValueError("an empty list of calls")
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("each call must be name(keyword=value, ...)")
        name = ast.unparse(node.func)
        if any(k.arg is None for k in node.keywords):
            raise ValueError("a call cannot unpack arguments")
        calls.append({"name": name,
                      "arguments": {k.arg: _literal(k.value) for k in node.keywords}})
    return calls


def _literal(node: ast.expr) -> Any:
    """A Python literal, with JSON's names for true, false and null."""
    if isinstance(node, ast.Name):
        if node.id not in _JSON_NAMES:
            raise ValueError(f"not a literal: {node.id}")
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("a dict cannot unpack another")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)
                if k is not None}
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    return ast.literal_eval(node)
