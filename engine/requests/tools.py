"""Tool calling without a model: tool schemas, the forcing grammar, parsing calls.

Tools use the OpenAI function format. Forced choices ("required"/"any" or a tool name)
become a Lark grammar whose JSON part is the tool's own argument schema, so the row can
only produce well-formed calls. Parsing prefers the model's mlx-lm tool parser and falls
back to the tagged-JSON format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.requests.constraints import LarkGrammar
from engine.requests.schemas import rebase_refs, strict_schema

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: a unique id, the tool's name and its arguments.

    ``text`` is the model's own text of the arguments object when the call streamed it
    (``engine.requests.channels``); it parses to ``arguments``.
    """

    id: str
    name: str
    arguments: dict[str, Any]
    text: str | None = None

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text: what every face sends, streamed or whole (one spelling,
        so a client's concatenated argument deltas equal the call it would get whole). The
        model's own text when the call streamed as it was generated, else ``arguments``
        serialised."""
        if self.text is not None:
            return self.text
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call as it streams (``StreamEvent.tool_call_deltas``).

    ``index`` is the call's place among the calls the stream sent: its place in
    ``Completion.tool_calls``, unless a call sent before it ended invalid (cut by the end
    of the row, or malformed at its close), which keeps its index and is listed in
    ``Completion.invalid_tool_calls`` with it. The first piece of a call carries its ``id``
    and ``name`` (``arguments`` ""); the ``arguments`` pieces that follow are the model's
    text as it is generated, and for a kept call they concatenate to its ``arguments_text``.
    A call that may still be dropped (a repeat, an extra call with parallel calls off) is
    held back until it cannot be, so a call the engine drops never appears here.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def call_deltas(index: int, call: ToolCall) -> tuple[ToolCallDelta, ...]:
    """The deltas of a call released whole: its id, name and arguments in one piece."""
    return (ToolCallDelta(index, call.id, call.name, call.arguments_text),)


@dataclass(frozen=True)
class InvalidToolCall:
    """Call-like output that did not parse; reported, never raised."""

    id: str
    name: str | None
    raw: str
    error: str
    index: int | None = None  # the index its pieces streamed under; None: never streamed


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


def quoted(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text)


def forced_call_grammar(
    tools: Sequence[ToolSpec],
    choice: str,
    parallel: bool,
    start: str = quoted(TOOL_CALL_START),
    end: str = quoted(TOOL_CALL_END),
    schema: dict[str, Any] | None = None,
) -> LarkGrammar:
    """A grammar that admits only well-formed calls (one, or several when parallel).

    ``start`` / ``end`` are Lark fragments for the call markers: a quoted string, or
    ``<tool_call>`` when the tokenizer has the marker as one special token (llguidance
    only matches special tokens written that way). ``schema`` is the call schema when the
    request built it already (``ChatRequest.call_schema``), so it is built once.
    """
    schema = schema if schema is not None else forced_call_schema(tools, choice)
    # A newline may follow the last call: models write one, and it must not force another.
    repeat = ' ("\\n" call)* "\\n"?' if parallel else ' "\\n"?'
    lark = (
        f"start: call{repeat}\n"
        f'call: {start} "\\n" body "\\n" {end}\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return LarkGrammar(lark)


def forced_call_schema(tools: Sequence[ToolSpec], choice: str) -> dict[str, Any]:
    """The JSON schema of one call body: {"name": <a chosen tool>, "arguments": {...}}."""
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    return {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name},
                       "arguments": _closed(t.parameters, f"#/anyOf/{i}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for i, t in enumerate(chosen)], "x-guidance": {"whitespace_flexible": False,
                                                     "item_separator": ", ", "key_separator": ": "}}


def _closed(schema: dict[str, Any], at: str) -> dict[str, Any]:
    # Forced calls name only declared arguments, at every level, unless the schema says
    # otherwise, as in OpenAI's strict mode; otherwise a small model can invent keys forever.
    # The schema now sits at ``at`` in the call schema: its local $refs must point there.
    return rebase_refs(strict_schema(schema), at)


def fallback_tool_prompt(tools: Sequence[ToolSpec]) -> str:
    """System-prompt text for chat templates that do not render tools themselves."""
    listing = "\n".join(json.dumps(t.as_openai()) for t in tools)
    return (
        "You have access to the following tools:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a tool, reply with one line per call in exactly this format:\n"
        f'{TOOL_CALL_START}{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}'
        f"{TOOL_CALL_END}\n"
        "Otherwise reply normally."
    )


def with_fallback_tool_prompt(messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Messages with the tool listing merged into (or prepended as) the system message."""
    text = fallback_tool_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(raw: str, parser: ToolParser | None, tools: Sequence[ToolSpec]) -> (
        ToolCall | InvalidToolCall):
    """Parse one call's markup body with the model's parser, else as tagged JSON."""
    text = raw.strip()
    call_id = new_call_id()
    try:
        parsed = parser(text, [t.as_openai() for t in tools]) if parser else json.loads(text)
        if isinstance(parsed, list) and len(parsed) == 1:
            parsed = parsed[0]
        if not isinstance(parsed, Mapping):
            raise ValueError("a tool call must be a JSON object")
        name = parsed.get("name")
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(name, str) or not name:
            raise ValueError("the call has no tool name")
        if not isinstance(arguments, Mapping):
            raise ValueError("the call's arguments are not a JSON object")
    except Exception as exc:  # any parser failure is reported, not raised
        guess = _guess_name(text)
        return InvalidToolCall(call_id, guess, raw, f"{type(exc).__name__}: {exc}")
    return ToolCall(call_id, name, dict(arguments))


def _guess_name(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value.get("name") if isinstance(value, dict) else None
