"""The grammar that forces tool calls: only well-formed calls to the chosen tools.

Forced choices ("required"/"any" or a tool name) become a Lark grammar whose JSON part is
the tool's own argument schema, closed as in OpenAI's strict mode, so the row can only
produce well-formed calls. No mlx.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.requests.constraints.schemas import rebase_refs, strict_schema
from engine.requests.inbound.output_constraint import LarkGrammar
from engine.requests.inbound.tool_prompts import TOOL_CALL_END, TOOL_CALL_START
from engine.requests.inbound.tool_specs import ToolSpec

# Compact JSON with fixed separators: the grammar then decides every separator.
# Numbers a forced call writes outside JSON (XML values, Gemma's call syntax): at most 16
# digits a part, so a forced value always ends.
BOUNDED_INTEGER = "/-?(0|[1-9][0-9]{0,15})/"
BOUNDED_NUMBER = "/-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?/"

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def quoted(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text)


def forced_call_grammar(
    tools: Sequence[ToolSpec],
    choice: str,
    parallel: bool,
    start: str = quoted(TOOL_CALL_START),
    end: str = quoted(TOOL_CALL_END),
) -> LarkGrammar:
    """A grammar that admits only well-formed calls (one, or several when parallel), each
    ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``.

    ``start`` / ``end`` are Lark fragments for the call markers: a quoted string, or
    ``<tool_call>`` when the tokenizer has the marker as one special token (llguidance
    only matches special tokens written that way).
    """
    return forced_grammar(tagged_json_calls(tools, choice, parallel, start, end))


def forced_grammar(calls: str, prefix: str = "") -> LarkGrammar:
    """The whole forced grammar around a dialect's ``calls`` rule: ``prefix`` (Lark, e.g.
    the end of an open reasoning block) before them. A newline may follow the last call:
    models write one, and it must not force another."""
    lead = f"{prefix} " if prefix else ""
    return LarkGrammar(f'start: {lead}calls "\\n"?\n{calls}')


def tagged_json_calls(tools: Sequence[ToolSpec], choice: str, parallel: bool, start: str,
                      end: str) -> str:
    """Lark defining ``calls``: JSON call objects between ``start`` and ``end``."""
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"calls: call{repeat}\n"
            f'call: {start} "\\n" call_body "\\n" {end}\n'
            f"call_body: %json {json.dumps(forced_call_schema(tools, choice))}\n")


def chosen_tools(tools: Sequence[ToolSpec], choice: str) -> list[ToolSpec]:
    """The tools a forced choice allows: all ("required") or the named one."""
    return [t for t in tools if choice == "required" or t.name == choice]


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """A tool's arguments as a forced call may write them: closed at every level (OpenAI's
    strict mode), compact JSON."""
    return compact_schema(tool.parameters)


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema (a tool's arguments, or one argument) as ``%json`` in a forced call writes
    it: closed at every level, compact JSON."""
    return {**strict_schema(schema), "x-guidance": _COMPACT}


def forced_call_schema(tools: Sequence[ToolSpec], choice: str) -> dict[str, Any]:
    """The JSON schema of one call body: {"name": <a chosen tool>, "arguments": {...}}."""
    chosen = chosen_tools(tools, choice)
    return {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name},
                       "arguments": _closed(t.parameters, f"#/anyOf/{i}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for i, t in enumerate(chosen)], "x-guidance": _COMPACT}


def _closed(schema: dict[str, Any], at: str) -> dict[str, Any]:
    # Forced calls name only declared arguments, at every level, unless the schema says
    # otherwise, as in OpenAI's strict mode; otherwise a small model can invent keys forever.
    # The schema now sits at ``at`` in the call schema: its local $refs must point there.
    return rebase_refs(strict_schema(schema), at)


def separated(entries: Sequence[tuple[str, bool]], sep: str) -> str:
    """Lark for ``entries`` (a Lark expression, whether it is required) in order, the
    optional ones optional, ``sep`` (Lark) between those written: a call's keyword
    arguments, an object's keys. ``'""'`` when there are none."""
    def tail(k: int) -> str:  # entries k.. after something was written
        if k == len(entries):
            return ""
        entry, required = entries[k]
        step = f"{sep} {entry}" if required else f"({sep} {entry})?"
        return f"{step} {tail(k + 1)}".strip()

    def head(k: int) -> str:  # entries k.. with nothing written yet
        if k == len(entries):
            return ""
        entry, required = entries[k]
        first = f"{entry} {tail(k + 1)}".strip()
        if required:
            return first
        rest = head(k + 1)
        return f"({first} | {rest})" if rest else f"({first})?"

    return head(0) or '""'
