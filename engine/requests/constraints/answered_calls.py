"""The guard against repeating an answered call: a tool's arguments minus those answered.

An agent's history holds the calls the model made and the tool results they got. A small
greedy model (SmolLM2-135M under ``create_agent``) then writes the same call again, turn
after turn, instead of answering from the result. When tools share a request with a JSON
answer ("auto"), the union grammar can refuse exactly those repeats: a call to tool T is
admitted unless its arguments equal (as JSON values) the arguments of a call to T that
the history already answered. The model then makes another call or answers.

It is built as a JSON schema, so every family whose calls carry JSON arguments gets it
from its own grammar: the tool's argument schema becomes the ``anyOf`` of disjoint cases
of a decision tree over the properties, in schema order. At property ``k``, with the
answered objects that agree on every earlier property: either ``k`` differs from all
their values for ``k`` (the rest is free), or ``k`` equals one of them and the rest is
decided by the objects that share it. Where every property agrees, the case is empty.
"Differs" is a schema for each kind of value: the other enum members or boolean, integer
and number intervals around the answered ones, a string pattern that matches every text
but the answered ones, nested objects by the same tree; an absent optional property is a
value of its own. Where a value cannot be stated that way (arrays, a string with its own
pattern or format, union types), the tool is left as it was: the guard never
refuses a call that is not a repeat. No mlx, no llguidance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any

from engine.requests.inbound.messages import Message
from engine.requests.inbound.tool_specs import ToolSpec

# A property the call left out: a value of its own in the decision tree.
_ABSENT = object()


class Inexpressible(Exception):
    """The answered values of a property cannot be excluded by a schema of its kind."""


def answered_arguments(messages: Sequence[Message]) -> dict[str, list[Mapping[str, Any]]]:
    """Tool name -> the arguments of each past call that a ``tool`` message answered.

    A call is answered when a later tool message carries its id; a call without an id
    (some clients drop them) when a later tool message has no id either, or names the
    tool. A call still waiting for its result is not answered, so it is never refused."""
    answered: dict[str, list[Mapping[str, Any]]] = {}
    for i, message in enumerate(messages):
        later = [m for m in messages[i + 1:] if m.role == "tool"]
        for call in message.tool_calls:
            if any(_answers(result, call.id, call.name) for result in later):
                answered.setdefault(call.name, []).append(call.arguments)
    return answered


def within_limit(tools: Iterable[ToolSpec],
                 answered: Mapping[str, Sequence[Mapping[str, Any]]],
                 limit: int | None) -> tuple[ToolSpec, ...]:
    """``tools`` less those the history already called and answered ``limit`` times (a
    per-tool call limit the request set; None keeps them all)."""
    if limit is None:
        return tuple(tools)
    return tuple(t for t in tools if len(answered.get(t.name, ())) < limit)


def _answers(result: Message, call_id: str, name: str) -> bool:
    if call_id:
        return result.tool_call_id == call_id
    return not result.tool_call_id or result.name == name


def unanswered_tools(tools: Iterable[ToolSpec],
                     answered: Mapping[str, Sequence[Mapping[str, Any]]],
                     json_arguments: bool = True) -> tuple[ToolSpec, ...]:
    """``tools`` with each answered call refused: a tool whose every possible call was
    answered (e.g. one without parameters, called once) is left out; the others get
    ``excluding`` argument schemas when ``json_arguments`` (the family writes its
    arguments as JSON, which the grammar reads with the schema); otherwise they stay."""
    kept = []
    for tool in tools:
        calls = answered.get(tool.name)
        if not calls:
            kept.append(tool)
            continue
        schema = excluding(tool.parameters, calls)
        if schema is None:
            kept.append(tool)
        elif not _is_empty(schema):
            kept.append(replace(tool, parameters=schema) if json_arguments else tool)
    return tuple(kept)


def excluding(parameters: Mapping[str, Any],
              calls: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """An argument schema that admits what ``parameters`` admits except each of ``calls``
    (``{"anyOf": []}`` when nothing is left), or None when that cannot be stated."""
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    body = {k: v for k, v in parameters.items() if k not in defs}
    try:
        cases = _objects_except(body, [c for c in calls if isinstance(c, Mapping)])
    except Inexpressible:
        return None
    return {**defs, "anyOf": cases}


def _is_empty(schema: Mapping[str, Any]) -> bool:
    return schema.get("anyOf") == []


def _objects_except(schema: Mapping[str, Any],
                    objects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Disjoint object schemas whose union is ``schema`` minus ``objects``."""
    kind = schema.get("type", "object" if "properties" in schema else None)
    if kind != "object" or schema.get("additionalProperties", False) is not False or \
            _combines(schema):
        raise Inexpressible("only a closed object with declared properties")
    properties: dict[str, Any] = dict(schema.get("properties") or {})
    required = set(schema.get("required") or ())
    keys = list(properties)
    # A call the grammar could never write cannot be repeated: only those it admits count.
    objects = [o for o in objects if _fits(schema, o)]

    def case(fixed: Mapping[str, tuple[Any, bool]]) -> dict[str, Any]:
        # ``fixed``: key -> (its schema in this case, or _ABSENT: left out; must appear).
        props, need = {}, []
        for key, sub in properties.items():
            sub, must = fixed.get(key, (sub, key in required))
            if sub is not _ABSENT:
                props[key] = sub
                need += [key] if must else []
        return {**{k: v for k, v in schema.items() if k not in ("properties", "required")},
                "type": "object", "properties": props, "required": need,
                "additionalProperties": False}

    def tree(i: int, left: Sequence[Mapping[str, Any]],
             fixed: dict[str, tuple[Any, bool]]) -> list[dict[str, Any]]:
        if not left:
            return [case(fixed)]
        if i == len(keys):
            return []  # every property equals an answered call's: refused
        key, sub = keys[i], properties[keys[i]]
        groups: dict[str, tuple[Any, list[Mapping[str, Any]]]] = {}
        for o in left:
            value = o.get(key, _ABSENT)
            groups.setdefault(_identity(value), (value, []))[1].append(o)
        absent_answered = "\0absent" in groups
        others = _values_except(sub, [v for v, _ in groups.values() if v is not _ABSENT])
        out = []
        if others:  # k differs from every answered value (present, if absence was answered)
            differ = others[0] if len(others) == 1 else {"anyOf": others}
            out.append(case({**fixed, key: (differ, key in required or absent_answered)}))
        elif key not in required and not absent_answered:
            out.append(case({**fixed, key: (_ABSENT, False)}))  # the one other "value"
        for value, same in groups.values():
            pinned = (_ABSENT, False) if value is _ABSENT else ({"const": value}, True)
            out += tree(i + 1, same, {**fixed, key: pinned})
        return out

    return tree(0, objects, {})


def _fits(schema: Mapping[str, Any], value: Any) -> bool:
    """Whether ``schema`` admits ``value``, for the schemas ``_values_except`` handles (a
    pinned answered value must be one the grammar admits, or pinning it would widen it)."""
    if "const" in schema and _identity(schema["const"]) != _identity(value):
        return False
    if "enum" in schema and all(_identity(c) != _identity(value) for c in schema["enum"]):
        return False
    kind = schema.get("type", "object" if "properties" in schema else None)
    if kind is None and ("const" in schema or "enum" in schema):
        return True
    if kind == "object":
        props = schema.get("properties") or {}
        return (isinstance(value, Mapping) and set(value) <= set(props)
                and set(schema.get("required") or ()) <= set(value)
                and all(_fits(props[k], v) for k, v in value.items()))
    low, high = schema.get("minimum"), schema.get("maximum")
    in_bounds = _is_number(value) and (low is None or value >= low) and (
        high is None or value <= high)
    fits = {"string": isinstance(value, str), "boolean": isinstance(value, bool),
            "null": value is None, "number": in_bounds,
            "integer": in_bounds and float(value).is_integer()}
    if kind not in fits:  # arrays, type lists, untyped values: the guard stays out
        raise Inexpressible(f"cannot read values of {schema!r:.60}")
    return fits[kind]


def _values_except(schema: Mapping[str, Any], values: Sequence[Any]) -> list[dict[str, Any]]:
    """Disjoint schemas whose union is ``schema``'s values minus ``values``; when ``schema``
    is optional in its object, absence is not among them (the caller handles it)."""
    if not values:
        return [dict(schema)]
    if "enum" in schema or "const" in schema:
        choices = schema["enum"] if "enum" in schema else [schema["const"]]
        rest = [c for c in choices if all(_identity(c) != _identity(v) for v in values)]
        base = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        return [{**base, "enum": rest}] if rest else []
    kind = schema.get("type")
    # Length bounds stay beside the pattern (llguidance intersects them); a pattern of
    # its own cannot be intersected with this one in a schema.
    if kind == "string" and not _keys(schema, "pattern", "format", "anyOf", "oneOf",
                                      "allOf", "$ref"):
        texts = sorted({v for v in values if isinstance(v, str)})
        return [{**schema, "pattern": f"^{_texts_except(texts)}$"}]
    if kind == "boolean":
        rest = [b for b in (False, True) if not any(v is b for v in values)]
        return [{**schema, "enum": rest}] if rest else []
    if kind == "null":
        return [] if any(v is None for v in values) else [dict(schema)]
    if kind == "integer" and not _keys(schema, "multipleOf", "exclusiveMinimum",
                                       "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref"):
        return _integers_except(schema, values)
    if kind == "number" and not _keys(schema, "multipleOf", "exclusiveMinimum",
                                      "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref"):
        return _numbers_except(schema, values)
    if kind == "object":
        return _objects_except(schema, [v for v in values if isinstance(v, Mapping)])
    raise Inexpressible(f"cannot exclude values of {schema!r:.60}")


def _integers_except(schema: Mapping[str, Any], values: Sequence[Any]) -> list[dict[str, Any]]:
    """The integer intervals between the excluded integers, inside the schema's bounds."""
    low, high = schema.get("minimum"), schema.get("maximum")
    out = []
    for v in sorted({int(v) for v in values if _is_number(v) and float(v).is_integer()}):
        if (low is None or v >= low) and (high is None or v <= high):
            if low is None or v - 1 >= low:
                out.append(_bounded(schema, low, v - 1))
            low = v + 1
    if high is None or low is None or low <= high:
        out.append(_bounded(schema, low, high))
    return out


def _numbers_except(schema: Mapping[str, Any], values: Sequence[Any]) -> list[dict[str, Any]]:
    """Open intervals between the excluded numbers, inside the schema's bounds (21 and
    21.0 are one value, as JSON parsers read them)."""
    low, high = schema.get("minimum"), schema.get("maximum")
    cuts = sorted({float(v) for v in values if _is_number(v)
                   and (low is None or v >= low) and (high is None or v <= high)})
    if not cuts:
        return [dict(schema)]
    base = {k: v for k, v in schema.items() if k not in ("minimum", "maximum")}
    out = [{**base, **({"minimum": low} if low is not None else {}),
            "exclusiveMaximum": cuts[0]}] if low is None or low < cuts[0] else []
    out += [{**base, "exclusiveMinimum": a, "exclusiveMaximum": b}
            for a, b in pairwise(cuts)]
    if high is None or high > cuts[-1]:
        out.append({**base, "exclusiveMinimum": cuts[-1],
                    **({"maximum": high} if high is not None else {})})
    return out


def _bounded(schema: Mapping[str, Any], low: Any, high: Any) -> dict[str, Any]:
    base = {k: v for k, v in schema.items() if k not in ("minimum", "maximum")}
    return {**base, **({"minimum": low} if low is not None else {}),
            **({"maximum": high} if high is not None else {})}


# llguidance parses a pattern with regex-syntax, which refuses more than 250 nested
# groups, alternations and concatenations; each trie level below costs 4 of them.
_MAX_NESTING = 200
# Characters of an unbranched run written flat, one alternative per place to leave it:
# fewer levels, at a quadratic cost in the run's length.
_RUN = 16


def _texts_except(texts: Sequence[str], nesting: int = 0) -> str:
    """A regex (no look-around: llguidance has none) for every string except ``texts``:
    by their trie, a string leaves it at some character, stops short, or runs on.

    Raises ``Inexpressible`` when the trie is too deep for llguidance's regex parser
    (very long answered texts); the guard then stays out rather than fail the request.
    """
    if not texts:
        return r"[\s\S]*"
    if nesting > _MAX_NESTING:
        raise Inexpressible("answered texts too long to exclude by a pattern")
    run = _shared_run(texts)
    if run:  # a stretch where every text goes on alike: leave it at any place, or stop short
        exits = [_literal(run[:j]) + "([^" + _char(c) + r"][\s\S]*)?"
                 for j, c in enumerate(run)]
        rest = _texts_except([t[len(run):] for t in texts], nesting + 4)
        return "(" + "|".join([*exits, _literal(run) + rest]) + ")"
    alternatives = [] if "" in texts else [""]
    firsts = sorted({t[0] for t in texts if t})
    leave = "[^" + "".join(_char(c) for c in firsts) + "]" if firsts else r"[\s\S]"
    alternatives.append(leave + r"[\s\S]*")
    for c in firsts:
        alternatives.append(_char(c) + _texts_except([t[1:] for t in texts
                                                      if t and t[0] == c], nesting + 4))
    return "(" + "|".join(alternatives) + ")"


def _shared_run(texts: Sequence[str]) -> str:
    """The characters (at most ``_RUN``, none if fewer than 2) every text starts with, no
    text ending inside them (an answered text that ends there must stay refused)."""
    shortest = min(len(t) for t in texts)
    run = ""
    for i in range(min(shortest - 1, _RUN)):
        if any(t[i] != texts[0][i] for t in texts):
            break
        run += texts[0][i]
    return run if len(run) >= 2 else ""


def _literal(text: str) -> str:
    return "".join(_char(c) for c in text)


def _char(c: str) -> str:
    # Every character escaped by code point, the same in a class and outside one; \\U with
    # eight digits reads alike in llguidance (Rust) and Python, so tests can check it.
    return f"\\U{ord(c):08x}"


def _identity(value: Any) -> str:
    """One key per JSON value as a parser reads it: 21 and 21.0 alike, True apart from 1."""
    if value is _ABSENT:
        return "\0absent"
    if _is_number(value) and float(value).is_integer() and math.isfinite(value):
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _keys(schema: Mapping[str, Any], *names: str) -> bool:
    return any(n in schema for n in names)


def _combines(schema: Mapping[str, Any]) -> bool:
    return _keys(schema, "anyOf", "oneOf", "allOf", "$ref", "not", "if", "patternProperties",
                 "dependentSchemas", "dependencies", "unevaluatedProperties")
