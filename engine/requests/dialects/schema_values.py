"""One argument value by its JSON schema, for families that write values outside JSON.

Qwen's XML and Gemma 4's call syntax each write a value by the schema's type; they write
strings, objects and arrays their own way, but an enum as one of its values and integers,
numbers and booleans bare, as JSON spells them. These are the shared pieces: the schema's
type, and the Lark of the values every such family writes alike. No mlx here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.requests.constraints.forced_calls import BOUNDED_INTEGER, BOUNDED_NUMBER

_BARE = {"integer": BOUNDED_INTEGER, "number": BOUNDED_NUMBER, "boolean": '("true" | "false")'}


def main_type(schema: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(the schema's one non-null type or None, whether null is allowed)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [k for k in kind if k != "null"]
        return (named[0] if len(named) == 1 else None), "null" in kind
    return (kind if isinstance(kind, str) else None), kind == "null"


def bare_value(kind: str | None) -> str | None:
    """Lark for an integer, number or boolean written bare (numbers of at most 16 digits a
    part, so a forced value always ends); None for any other kind."""
    return _BARE.get(kind) if kind is not None else None


def enum_value(schema: Mapping[str, Any], constant: Callable[[Any], str]) -> str | None:
    """Lark for one of the schema's enum values, each written by ``constant``; None when
    the schema has no enum."""
    values = schema.get("enum")
    if not isinstance(values, list) or not values:
        return None
    return "(" + " | ".join(constant(value) for value in values) + ")"
