"""What a constrained row may produce: a JSON schema, any JSON object, a regex, or Lark.

Pure data, validated cheaply here; compiling to a token-level matcher happens on the
engine thread (``engine.requests.constraints.grammar``), where an invalid grammar is
reported to the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidConstraintError


@dataclass(frozen=True)
class JsonSchema:
    """Output must be JSON valid against ``schema`` (a dict or the JSON text of one).

    Strict by default: every object level refuses keys it does not declare (the grammar
    adds ``"additionalProperties": false`` wherever the schema leaves it unsaid, as in
    OpenAI's strict mode; see ``engine.requests.constraints.schemas.strict_schema``). To let
    an object take any keys, write ``"additionalProperties": true`` (or a schema for the
    values) at its level.
    """

    schema: str

    def __init__(self, schema: Mapping[str, Any] | str) -> None:
        if isinstance(schema, Mapping):
            try:
                text = json.dumps(schema, default=_mapping_as_dict)  # key order is kept
            except (TypeError, ValueError) as exc:
                raise InvalidConstraintError(f"JsonSchema: schema is not JSON: {exc}") from exc
        elif isinstance(schema, str):
            try:
                loaded = json.loads(schema)
            except ValueError as exc:
                raise InvalidConstraintError(
                    f"JsonSchema: schema is not valid JSON: {exc}") from exc
            if not isinstance(loaded, dict):
                kind = _JSON_TYPES.get(type(loaded), "value")
                raise InvalidConstraintError(
                    "JsonSchema: schema must be a JSON object (a dict or the JSON text of "
                    f"one), got a JSON {kind}: {schema.strip()[:40]!r}")
            text = schema
        else:
            raise InvalidConstraintError(
                "JsonSchema: schema must be a dict or the JSON text of an object, got "
                f"{type(schema).__name__} {schema!r:.40}")
        object.__setattr__(self, "schema", text)

    @property
    def schema_dict(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.schema)
        return loaded


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _mapping_as_dict(value: object) -> dict[str, Any]:
    # json.dumps writes only dicts; any other Mapping (nested too) is a dict in JSON.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclass(frozen=True)
class JsonObject:
    """Output must be one JSON object (any keys)."""


@dataclass(frozen=True)
class Regex:
    """Output must match ``pattern`` in full."""

    pattern: str

    def __post_init__(self) -> None:
        _check_text(self.pattern, "Regex", "pattern")


@dataclass(frozen=True)
class LarkGrammar:
    """Output must be derivable from this Lark grammar (llguidance's dialect)."""

    grammar: str

    def __post_init__(self) -> None:
        _check_text(self.grammar, "LarkGrammar", "grammar")


def _check_text(value: object, kind: str, name: str) -> None:
    # Anything but text reached llguidance's compiler as an internal TypeError.
    if not isinstance(value, str):
        raise InvalidConstraintError(
            f"{kind}: {name} must be a str, got {type(value).__name__} {value!r:.40}")
    if not value.strip():
        raise InvalidConstraintError(f"{kind}: {name} must not be empty")


Constraint = JsonSchema | JsonObject | Regex | LarkGrammar
