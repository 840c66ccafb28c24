"""LlamaIndex's tools and tool calls: tools in as the engine's ``ToolSpec`` values, an
assistant message's calls out as ``ToolSelection``s (or OpenAI's wire shape, to replay), and
a response kept to its first call when parallel calls were not allowed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from engine import ToolSpec, normalize_tools


def tool_call_dict(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's wire shape; its arguments are read by the engine's rulebook."""
    return {"id": call_id or "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def legacy_call(raw: Any) -> dict[str, Any] | None:
    """A call kept by other integrations: an OpenAI dict or object, or a ToolSelection."""
    if isinstance(raw, ToolSelection):
        return tool_call_dict(raw.tool_id, raw.tool_name, raw.tool_kwargs)
    if isinstance(raw, Mapping):
        fn = raw.get("function", raw)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not name:
            return None
        return tool_call_dict(raw.get("id"), str(name), fn.get("arguments", fn.get("args")))
    fn = getattr(raw, "function", None)
    name = getattr(fn, "name", None)
    if not name:
        return None
    return tool_call_dict(getattr(raw, "id", None), str(name), getattr(fn, "arguments", None))


def tool_specs(tools: Iterable[Any]) -> tuple[ToolSpec, ...]:
    """LlamaIndex tools (or OpenAI dicts) as the engine's tool specs, converted once."""
    if isinstance(tools, tuple) and all(isinstance(t, ToolSpec) for t in tools):
        return tools
    return normalize_tools([openai_tool(tool) for tool in tools])


def openai_tool(tool: Any) -> dict[str, Any]:
    """A LlamaIndex tool (or an OpenAI tool dict already) in the OpenAI function format."""
    if isinstance(tool, Mapping):
        return dict(tool)
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "to_openai_tool"):
        raise TypeError(f"expected a LlamaIndex tool or an OpenAI tool dict, got {tool!r}")
    return dict(metadata.to_openai_tool(skip_length_check=True))


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The tool calls of an assistant message, each with a distinct ``tool_id``."""
    found: list[ToolSelection] = []
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            found.append(_selection(block.tool_call_id, block.tool_name, block.tool_kwargs))
    if not found:  # histories built by other integrations keep calls in additional_kwargs
        for raw in message.additional_kwargs.get("tool_calls") or ():
            call = legacy_call(raw)
            if call is not None:
                fn = call["function"]
                found.append(_selection(call["id"], fn["name"], fn["arguments"]))
    return found


def _selection(call_id: str | None, name: str, arguments: Any) -> ToolSelection:
    """A ToolSelection; a call without an id gets a fresh one (agents match results by id)."""
    kwargs = arguments if isinstance(arguments, Mapping) else _arguments(arguments)
    return ToolSelection(tool_id=call_id or f"call_{uuid.uuid4().hex[:24]}",
                         tool_name=name, tool_kwargs=dict(kwargs))


def _arguments(arguments: Any) -> dict[str, Any]:
    """A legacy call's JSON-text arguments; text that is no JSON object is refused."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, got {arguments!r:.40}")
    return value


def keep_first_call(response: ChatResponse) -> ChatResponse:
    """The response with only its first tool call (when parallel calls were not allowed)."""
    message = response.message
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) <= 1:
        return response
    blocks = [b for b in message.blocks if not isinstance(b, ToolCallBlock)] + calls[:1]
    trimmed = message.model_copy(update={"blocks": blocks})
    return response.model_copy(update={"message": trimmed})
