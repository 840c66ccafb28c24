"""JSON-schema rewrites for constrained output: strict objects and relocated ``$ref`` s.

Pure functions on plain JSON data; no llguidance, no mlx. ``strict_schema`` gives every
object level ``additionalProperties: false`` (OpenAI strict-mode semantics), so a model
can only write the keys a schema declares; ``rebase_refs`` keeps a schema's local
``$ref`` s pointing at the right place once it is embedded in a larger schema.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

Path = tuple[str | int, ...]  # a JSON pointer, split: str keys, int list indices

# Where subschemas live.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "contains", "then", "else",
               "unevaluatedItems", "unevaluatedProperties")
# Conditions: closing an object inside one would make the outer schema admit more, not
# less, so strict_schema does not enter them (rebase_refs does).
_CONDITIONS = ("not", "if")
# Applied to the same instance as the schema holding them: their keys merge with its keys.
_CONJUNCTIVE_LISTS = ("allOf",)
_CONJUNCTIVE_ONE = ("then", "else")
_CONJUNCTIVE_MAPS = ("dependentSchemas", "dependencies")
_DISJUNCTIVE_LISTS = ("anyOf", "oneOf")


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``schema`` in which undeclared keys are refused at every level.

    Every object level — ``"type": "object"`` (alone or in a type list), or ``properties``
    with no ``type`` — gets ``"additionalProperties": false`` appended, wherever it sits:
    nested properties, ``$defs``/``definitions`` (so ``$ref`` targets), array ``items``
    and ``prefixItems``, ``anyOf``/``oneOf``/``allOf`` branches, ``then``/``else``,
    ``additionalProperties`` given as a schema. Left as written:

    * a level that states ``additionalProperties`` (or ``unevaluatedProperties``) itself;
      write ``"additionalProperties": true`` to let a level take any keys. Objects nested
      inside such a level are still closed.
    * a level whose keys are split between it and the subschemas applied beside it
      (``{"properties": ..., "allOf"/"anyOf": [{"properties": ...}]}``, or several
      ``allOf`` parts with properties): JSON Schema's ``additionalProperties`` sees only
      its own level's ``properties``, so closing any part would refuse keys another part
      declares. Those levels stay open; objects nested in them are still closed.
    * ``not`` and ``if`` subschemas (closing inside a condition loosens the schema).

    Key order is kept (fields are generated in schema order); ``schema`` is not modified.
    """
    root: dict[str, Any] = _plain(schema)
    merged = _merged_levels(root)
    for path, node in list(_walk(root, ())):  # listed first: the loop adds keys to nodes
        if _is_object(node) and not _states_extra_keys(node) and path not in merged:
            node["additionalProperties"] = False
    return root


def rebase_refs(schema: Mapping[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of ``schema`` whose local ``$ref`` s resolve once it sits at ``pointer``.

    ``"#/$defs/X"`` becomes ``pointer + "/$defs/X"`` (``pointer`` is a ``#/...`` JSON
    pointer into the enclosing schema); other references are left as they are.
    """
    root: dict[str, Any] = _plain(schema)
    for _, node in _walk(root, (), conditions=True):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = pointer + ref[1:]
    return root


def _plain(value: Any) -> Any:
    # A deep copy in plain dicts and lists, so any Mapping or tuple the caller used works.
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return copy.deepcopy(value)


def _walk(node: Any, path: Path,
          conditions: bool = False) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every schema object under ``node`` (itself included), with its path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _walk(sub, (*path, key, name), conditions)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                yield from _walk(sub, (*path, key, index), conditions)
        elif key in _SCHEMA_ONE or (conditions and key in _CONDITIONS):
            yield from _walk(value, (*path, key), conditions)


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is None:
        return "properties" in node
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _states_extra_keys(node: dict[str, Any]) -> bool:
    # The user already chose what happens to undeclared keys at this level.
    return "additionalProperties" in node or "unevaluatedProperties" in node


def _merged_levels(root: dict[str, Any]) -> set[Path]:
    """Object levels whose keys merge with a neighbour's, which closing would break."""
    merged: set[Path] = set()
    for path, node in _walk(root, ()):
        conjunctive = [_declarers(root, sub_path, sub, frozenset())
                       for sub_path, sub in _applied(root, path, node, conjunctive=True)]
        disjunctive = [_declarers(root, sub_path, sub, frozenset())
                       for sub_path, sub in _applied(root, path, node, conjunctive=False)]
        parts = sum(1 for found in conjunctive if found) + any(disjunctive)
        if parts and (_is_object(node) or parts >= 2):
            merged.add(path)
            merged.update(p for found in conjunctive + disjunctive for p in found if p is not None)
    return merged


def _applied(root: dict[str, Any], path: Path, node: dict[str, Any],
             conjunctive: bool) -> Iterator[tuple[Path | None, Any]]:
    """The subschemas applied to the same instance as ``node`` (None: an unknown $ref)."""
    lists = _CONJUNCTIVE_LISTS if conjunctive else _DISJUNCTIVE_LISTS
    for key in lists:
        value = node.get(key)
        if isinstance(value, list):
            for index, sub in enumerate(value):
                yield (*path, key, index), sub
    if not conjunctive:
        return
    for key in _CONJUNCTIVE_ONE:
        if key in node:
            yield (*path, key), node[key]
    for key in _CONJUNCTIVE_MAPS:
        schemas = node.get(key)
        if isinstance(schemas, dict):
            for name, sub in schemas.items():
                yield (*path, key, name), sub
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        yield (target if target is not None else (None, {"type": "object"}))


def _declarers(root: dict[str, Any], path: Path | None, node: Any,
               seen: frozenset[Path]) -> list[Path | None]:
    """The object levels whose keys ``node`` brings, through applicators and $refs."""
    if path is None:
        return [None]  # a $ref we cannot follow may bring keys: assume it does
    if not isinstance(node, dict) or path in seen:
        return []
    if _is_object(node):
        return [path]
    seen = seen | {path}
    return [found for conjunctive in (True, False)
            for sub_path, sub in _applied(root, path, node, conjunctive)
            for found in _declarers(root, sub_path, sub, seen)]


def _resolve(root: dict[str, Any], ref: str) -> tuple[Path, Any] | None:
    """The path and schema a local ``$ref`` (``#`` or ``#/a/b``) names, else None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    path: Path = ()
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node, path = node[token], (*path, token)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node, path = node[int(token)], (*path, int(token))
        else:
            return None
    return path, node
