"""What both generating endpoints ask of the engine besides messages: tools, tool choice
and the output constraint, from either wire format's (pydantic-validated) fields.

Chat completions nest a function under ``function`` (``tools[i].function.name``,
``tool_choice.function.name``, ``response_format.json_schema.schema``); Responses flatten
it (``tools[i].name``, ``tool_choice.name``, ``text.format.schema``). Each endpoint passes
its own fields; the conversion and its errors are written once, here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine import Constraint, JsonObject, JsonSchema
from mlx_providers.server.errors import APIError


class FunctionFields(Protocol):
    """A function tool as either endpoint validated it."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None


def engine_tools(functions: Sequence[FunctionFields] | None) -> list[dict[str, Any]] | None:
    """The engine's OpenAI-format tools (None when there are none)."""
    if not functions:
        return None
    return [{"type": "function", "function": {
        "name": f.name, "description": f.description or "",
        "parameters": f.parameters or {"type": "object", "properties": {}}}}
        for f in functions]


def tool_choice_name(choice: Any) -> str | None:
    """"auto"/"none"/"required" as given, or the tool a named choice names (either shape)."""
    if choice is None or isinstance(choice, str):
        return choice
    function = getattr(choice, "function", choice)  # chat nests the name, Responses not
    return str(function.name)


def output_constraint(kind: str | None, schema: dict[str, Any] | None,
                      param: str) -> Constraint | None:
    """The constraint of an output format (``text``, ``json_object``, ``json_schema``).

    ``param`` names the schema's field in this endpoint's request, for the 400 a missing
    or invalid schema gets.
    """
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return JsonObject()
    if schema is None:
        raise APIError(400, f"a format of type {kind} needs a schema", param=param,
                       code="missing_required_parameter")
    try:
        return JsonSchema(schema)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc
