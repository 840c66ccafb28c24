"""What a constrained row may produce: a JSON schema, any JSON object, a regex, or Lark.

Pure data, validated cheaply here; compiling to a token-level matcher happens on the
engine thread (``engine.grammar``), where an invalid grammar is reported to the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JsonSchema:
    """Output must be JSON valid against ``schema`` (a dict or its JSON text)."""

    schema: str

    def __init__(self, schema: Mapping[str, Any] | str) -> None:
        if isinstance(schema, Mapping):
            text = json.dumps(schema)  # key order matters: fields are generated in it
        elif isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"JsonSchema: schema is not valid JSON: {exc}") from exc
            text = schema
        else:
            raise TypeError(f"JsonSchema: schema must be a dict or JSON text, got {schema!r}")
        object.__setattr__(self, "schema", text)

    @property
    def schema_dict(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.schema)
        return loaded


@dataclass(frozen=True)
class JsonObject:
    """Output must be one JSON object (any keys)."""


@dataclass(frozen=True)
class Regex:
    """Output must match ``pattern`` in full."""

    pattern: str


@dataclass(frozen=True)
class LarkGrammar:
    """Output must be derivable from this Lark grammar (llguidance's dialect)."""

    grammar: str


Constraint = JsonSchema | JsonObject | Regex | LarkGrammar
