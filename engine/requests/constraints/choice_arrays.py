"""A loop guard for arrays of finite choices: at most one item per choice.

Greedy small models repeat a list item until ``max_tokens`` (SmolLM2 under LangChain's
``LLMToolSelectorMiddleware``: ``{"tools": ["translate", "translate", ...``); the string
guard (``string_repeats``) cannot see it, since each item is a short, complete string.
An array whose items are a finite set of choices (``enum``, ``const``, or ``anyOf`` /
``oneOf`` of those) and that states no ``maxItems`` gets ``maxItems`` = the number of
choices (or ``minItems``, if larger): the grammar then closes the array after that many.

Where the schema says ``uniqueItems: true`` this is exact: no valid array is longer. Where
it does not, a longer array is valid JSON Schema (a choice may be listed twice), so the
bound refuses some valid but repetitive answers; a schema that wants more writes its own
``maxItems``, which is kept. Uniqueness itself is not enforced: a grammar of every unique
ordering grows factorially with the choices, and the bound already ends the loop. No mlx.
"""

from __future__ import annotations

from typing import Any


def bound_choice_arrays(schema: Any) -> Any:
    """``schema`` (plain JSON data, modified in place and returned) with every array of
    finite choices bounded to one item per choice, where it states no ``maxItems``."""
    if isinstance(schema, list):
        for item in schema:
            bound_choice_arrays(item)
    elif isinstance(schema, dict):
        for value in schema.values():
            bound_choice_arrays(value)
        choices = _choices(schema.get("items"))
        if choices and "maxItems" not in schema:
            minimum = schema.get("minItems")
            schema["maxItems"] = max(choices, minimum if isinstance(minimum, int) else 0)
    return schema


def _choices(items: Any) -> int:
    """How many values an items schema allows, when that is a finite set; 0 otherwise."""
    if not isinstance(items, dict):
        return 0
    if isinstance(items.get("enum"), list):
        return len(items["enum"])
    if "const" in items:
        return 1
    for key in ("anyOf", "oneOf"):
        branches = items.get(key)
        if isinstance(branches, list) and branches:
            counts = [_choices(b) for b in branches]
            return sum(counts) if all(counts) else 0
    return 0
