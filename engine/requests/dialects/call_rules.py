"""The Lark a family's forced calls are assembled from.

Every family writes its forced calls the same way: a rule ``call_i`` per chosen tool,
``call`` the choice among them, and ``calls`` one call (several when parallel calls are
allowed) with the family's text around and between them. Only the body of one call is the
family's own; a body whose arguments are one JSON object takes them from ``json_arguments``.
No mlx here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from engine.requests.constraints.forced_calls import arguments_schema, chosen_tools
from engine.requests.inbound.tool_specs import ToolSpec

# (index, tool, rules) -> the Lark of one call to that tool; rules it needs are appended.
CallBody = Callable[[int, ToolSpec, list[str]], str]


def calls_lark(tools: Sequence[ToolSpec], choice: str, parallel: bool, body: CallBody, *,
               between: str = "", around: tuple[str, str] = ("", "")) -> str:
    """Lark defining ``calls``: one call to a chosen tool, or when ``parallel`` one or more,
    ``between`` (Lark) apart or back to back when it is empty; ``around`` (Lark) before and
    after them all."""
    names: list[str] = []
    rules: list[str] = []
    for i, tool in enumerate(chosen_tools(tools, choice)):
        names.append(f"call_{i}")
        first = len(rules)
        call = body(i, tool, rules)
        rules.insert(first, f"call_{i}: {call}")  # each call's rule before those it uses
    calls = " ".join(part for part in (around[0], _repeat(parallel, between), around[1])
                     if part)
    return "\n".join([f"calls: {calls}", f"call: {' | '.join(names)}", *rules]) + "\n"


def _repeat(parallel: bool, between: str) -> str:
    """Lark for the calls themselves: one, or one or more ``between`` apart."""
    if not parallel:
        return "call"
    return f"call ({between} call)*" if between else "call+"


def json_arguments(i: int, tool: ToolSpec, rules: list[str]) -> str:
    """The rule ``args_i``, the tool's arguments as one JSON object (its schema closed,
    compact), appended to ``rules``; its name."""
    rules.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
    return f"args_{i}"
