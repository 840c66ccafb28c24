"""Tools and the tool choice as a request states them, checked and normalised.

Tools use the OpenAI function format; ``normalize_tools`` turns them into ``ToolSpec``
values and ``normalize_tool_choice`` resolves the choice against them. Every refusal is an
``InvalidRequestError`` naming the bad field. No mlx.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolSpec:
    """One tool, normalised from the OpenAI function format (or its inner dict)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                 "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> tuple[ToolSpec, ...]:
    """Validate tool definitions (OpenAI function format, or its inner ``function`` dict).

    Raises TypeError/ValueError naming the bad entry: a name a call can be written with, a
    text description, and parameters that are a JSON-schema object.
    """
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise _refused(f"tools must be a list of tool dicts in the OpenAI function format, "
                        f"got {type(tools).__name__} {tools!r:.40}")
    specs = [_tool_spec(i, tool) for i, tool in enumerate(tools)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise _refused(f"duplicate tool names: {duplicates}", "tools")
    return tuple(specs)


# OpenAI's rule for function names, with dots and colons for namespaced (MCP) tools.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _tool_spec(i: int, tool: Any) -> ToolSpec:
    """One tool entry as a ToolSpec, or the error naming ``tools[i]`` and what is wrong."""
    at = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise _refused(f"{at} must be a dict in the OpenAI function format, got "
                        f"{type(tool).__name__} {tool!r:.40}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise _refused(f"{at}.type must be 'function', got {tool.get('type')!r:.40}")
        fn, at = tool["function"], f"{at}.function"
        if not isinstance(fn, Mapping):
            raise _refused(f"{at} must be a dict with name, description and parameters, "
                            f"got {type(fn).__name__}")
    else:
        fn = tool
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise _refused(f"{at}.name: the function name must be 1-64 letters, digits, '_', "
                         f"'-', '.' or ':', got {name!r:.70}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _refused(f"{at}.description must be a str, got {type(description).__name__}")
    parameters = fn.get("parameters")
    if parameters is None or (isinstance(parameters, Mapping) and not parameters):
        parameters = {"type": "object", "properties": {}}
    _check_parameters(parameters, f"{at}.parameters")
    return ToolSpec(name, description or "", dict(parameters))


def _check_parameters(parameters: Any, at: str) -> None:
    """A tool's parameters: a JSON-schema object whose properties are schemas."""
    if not isinstance(parameters, Mapping):
        raise _refused(f"{at} must be a JSON schema object (a dict), got "
                        f"{type(parameters).__name__} {parameters!r:.40}")
    if parameters.get("type", "object") != "object":
        raise _refused(f"{at}.type must be 'object': the arguments' JSON schema describes "
                         f"a JSON object, got {parameters.get('type')!r:.40}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping):
        raise _refused(f"{at}.properties must be an object mapping argument names to "
                         f"schemas, got {type(properties).__name__} {properties!r:.40}")
    for key, schema in properties.items():
        if not isinstance(key, str) or not isinstance(schema, Mapping | bool):
            raise _refused(f"{at}.properties[{key!r:.40}] must be a JSON schema (a dict), "
                             f"got {type(schema).__name__} {schema!r:.40}")
    required = parameters.get("required", [])
    if (not isinstance(required, list | tuple)
            or not all(isinstance(r, str) for r in required)):
        raise _refused(f"{at}.required must be a list of argument names, got "
                         f"{required!r:.40}")
    try:  # the template and the grammar both need the schema as JSON
        json.dumps(parameters, default=_as_dict)
    except (TypeError, ValueError) as exc:
        raise _refused(f"{at} is not JSON: {exc}") from exc


def _as_dict(value: object) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def normalize_tool_choice(choice: str | Mapping[str, Any] | None,
                          tools: Sequence[ToolSpec]) -> str:
    """"auto", "none", "required" (also "any"), or the name of one of ``tools``."""
    if choice is None:
        return "auto"
    if isinstance(choice, Mapping):
        if choice.get("type", "function") != "function":
            raise _refused(f"tool_choice type must be 'function', got "
                             f"{choice.get('type')!r:.40}")
        fn = choice.get("function", choice)
        choice = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(choice, str):
            raise _refused("tool_choice dict must name a function: "
                             "{'type': 'function', 'function': {'name': ...}}")
    if not isinstance(choice, str):
        raise _refused(f"tool_choice must be 'auto', 'none', 'required', a tool name or "
                        f"{{'function': {{'name': ...}}}}, got {type(choice).__name__} "
                        f"{choice!r:.40}")
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _refused("tool_choice='required' needs at least one tool")
        return choice
    if choice not in {t.name for t in tools}:
        raise _refused(f"tool_choice names {choice!r:.70}, which is not among the tools "
                         f"{[t.name for t in tools]}")
    return choice


def _refused(message: str, field: str | None = None) -> InvalidRequestError:
    """The rulebook's refusal of a tool or tool choice; the field leads the message."""
    found = re.match(r"[A-Za-z_][\w.\[\]]*", message)
    return InvalidRequestError(message, field or (found.group(0) if found else "tools"))
