"""LangChain's inputs as the engine's request values (pure, no model): messages -> the
engine's ``Message`` values through its one rulebook (``engine.messages_from_openai``, which
decodes their images: ``carries_images`` says when that is worth a worker thread),
LangChain tools and tool choices -> ``ToolSpec`` values and a resolved choice, response
formats -> constraints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel

from engine import (
    MEDIA_PARTS,
    InvalidRequestError,
    JsonObject,
    JsonSchema,
    Message,
    ToolSpec,
    messages_from_openai,
    normalize_tool_choice,
    normalize_tools,
)

REASONING_KEY = "reasoning_content"
PROVIDER = "mlx"
ToolLike = Mapping[str, Any] | type | Callable[..., Any] | BaseTool


# ----- messages in ---------------------------------------------------------------------


# LangChain's message types as OpenAI roles; any other type's name is taken as the role
# (and the engine's rulebook refuses the ones OpenAI does not know).
_TYPE_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
               "function": "function"}


def message_dict(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message in OpenAI's wire shape (the rulebook's input)."""
    item: dict[str, Any] = {"content": message.content}
    if isinstance(message, SystemMessage):
        item["role"] = "system"
    elif isinstance(message, HumanMessage):
        item["role"] = "user"
    elif isinstance(message, AIMessage):
        item["role"] = "assistant"
        # Only parsed calls were executed; invalid ones have no tool result to pair with.
        if message.tool_calls:
            item["tool_calls"] = [{"id": call.get("id") or "", "type": "function",
                                   "function": {"name": call["name"], "arguments": call["args"]}}
                                  for call in message.tool_calls]
        reasoning = past_reasoning(message)
        if reasoning:  # templates that take it (Qwen3's) render it back; others ignore it
            item[REASONING_KEY] = reasoning
    elif isinstance(message, ToolMessage):
        item.update(role="tool", tool_call_id=message.tool_call_id)
    elif isinstance(message, FunctionMessage):
        item["role"] = "function"
    elif isinstance(message, ChatMessage):
        item["role"] = message.role
    else:
        item["role"] = _TYPE_ROLES.get(message.type, message.type)
    if message.name:
        item["name"] = message.name
    return item


def past_reasoning(message: AIMessage) -> str:
    """An assistant turn's reasoning, to replay: ``reasoning_content`` (what this face
    returns), else the text of its v1 ``reasoning`` content blocks."""
    kept = message.additional_kwargs.get(REASONING_KEY)
    if isinstance(kept, str):
        return kept
    blocks = message.content if isinstance(message.content, list) else []
    return "".join(str(b.get("reasoning", "")) for b in blocks
                   if isinstance(b, Mapping) and b.get("type") == "reasoning")


# Content part types that carry an image: OpenAI's, the Responses API's, LangChain's own.


def carries_images(messages: Sequence[BaseMessage | Mapping[str, Any]]) -> bool:
    """Whether a message's content holds an image part: converting it decodes the image,
    work the async paths hand to a worker thread."""
    for message in messages:
        content = (message.get("content") if isinstance(message, Mapping)
                   else message.content)
        if isinstance(content, list) and any(
                isinstance(part, Mapping) and part.get("type") in MEDIA_PARTS
                for part in content):
            return True
    return False


def chat_messages(messages: Sequence[BaseMessage]) -> tuple[Message, ...]:
    """The engine's messages for a LangChain history, converted once by its rulebook.

    A ``ToolMessage`` with ``status="error"`` says so in its text (OpenAI's shape has no
    status), so the model sees that the call failed.
    """
    converted = messages_from_openai([message_dict(m) for m in messages])
    return tuple(
        replace(m, content=f"Error: {m.content}")
        if isinstance(lc, ToolMessage) and lc.status == "error"
        and not m.content.startswith("Error") else m
        for lc, m in zip(messages, converted, strict=True))


# ----- tools and output formats ----------------------------------------------------------


def openai_tools(tools: Sequence[ToolLike], strict: bool | None = None) -> list[dict[str, Any]]:
    """Any LangChain tool, pydantic model, function or dict in the OpenAI tool format."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tools, got {type(tools).__name__}")
    return [_openai_tool(i, t, strict) for i, t in enumerate(tools)]


def _openai_tool(i: int, tool: Any, strict: bool | None) -> dict[str, Any]:
    # LangChain's converter says only "Unsupported function" for what it cannot convert.
    if not (isinstance(tool, Mapping | type | BaseTool) or callable(tool)):
        raise TypeError(f"tools[{i}] must be a LangChain tool, pydantic model, function or "
                        f"OpenAI tool dict, got {type(tool).__name__} {tool!r:.40}")
    try:
        return convert_to_openai_tool(tool, strict=strict)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"tools[{i}] cannot be read as a tool ({tool!r:.40}): {exc}") from exc


class BoundTools(list[dict[str, Any]]):
    """Tools as ``bind_tools`` binds them: OpenAI dicts (what LangChain tracing reads), and
    the engine's ``ToolSpec`` values converted from them once, at bind time.

    A refusal of the engine's (duplicate names, a bad schema) is raised when the tools are
    used, as before: binding never failed for those, and LangChain's standard tests bind
    such lists without calling them.
    """

    def __init__(self, tools: Sequence[dict[str, Any]], specs: tuple[ToolSpec, ...],
                 error: InvalidRequestError | None = None) -> None:
        super().__init__(tools)
        self._specs = specs
        self.error = error

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """The engine's tool specs; raises the engine's refusal of these tools, if any."""
        if self.error is not None:
            raise self.error
        return self._specs

    @property
    def names(self) -> tuple[ToolSpec, ...]:
        """Specs that only carry the tools' names: enough to check a tool choice."""
        if self.error is None:
            return self._specs
        return tuple(ToolSpec(str(t.get("function", {}).get("name"))) for t in self)


def tool_specs(tools: Any, strict: bool | None = None) -> BoundTools:
    """Any LangChain tools as the engine's tool specs, converted once (bound tools pass)."""
    if isinstance(tools, BoundTools):
        return tools
    formatted = openai_tools(tools, strict=strict)
    try:
        return BoundTools(formatted, normalize_tools(formatted))
    except InvalidRequestError as exc:
        return BoundTools(formatted, (), exc)


def tool_choice_name(choice: Any,
                     tools: Sequence[ToolSpec] | Sequence[Mapping[str, Any]]) -> str | None:
    """LangChain's spellings of tool_choice -> "auto", "none", "required" or a tool name.

    LangChain's own spellings (True, False, "any", Anthropic's {"name"}) are renamed here;
    the engine resolves the rest once (``normalize_tool_choice``), refusing a name that
    is not among ``tools`` (at bind time when bound).
    """
    if choice is None:
        return None
    tools = tools.names if isinstance(tools, BoundTools) else tuple(
        t if isinstance(t, ToolSpec) else normalize_tools([t])[0] for t in tools)
    if choice is True:
        return "required"
    if choice is False:
        return "none"
    if isinstance(choice, Mapping) and "function" not in choice and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}  # Anthropic's
    if isinstance(choice, str) and (choice in ("auto", "none", "required")
                                    or choice in {t.name for t in tools}):
        return choice  # resolved already (at bind time): nothing to convert
    try:
        return normalize_tool_choice(choice, tools)
    except ValueError as exc:
        names = [t.name for t in tools]
        if isinstance(choice, str) and choice not in names:
            raise type(exc)(f"tool_choice {choice!r} is not among the bound tools {names}",
                            "tool_choice") from exc
        raise


def json_schema_of(schema: Mapping[str, Any] | type) -> dict[str, Any]:
    """A JSON schema for pydantic, TypedDict, OpenAI-tool or JSON-schema inputs."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()  # keeps $defs, which the grammar resolves
    if isinstance(schema, Mapping) and "function" not in schema and (
            "properties" in schema or "type" in schema or "$defs" in schema):
        return dict(schema)  # already a JSON schema (a title is optional here)
    # pydantic v1 models, TypedDict classes and OpenAI tool dicts (all accepted at runtime).
    if not isinstance(schema, Mapping | type):
        raise TypeError(f"schema must be a pydantic model, TypedDict, JSON schema dict or "
                        f"OpenAI tool dict, got {type(schema).__name__} {schema!r:.40}")
    try:
        return convert_to_json_schema(schema)  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # LangChain's converter says only "Unsupported function".
        raise ValueError(f"schema cannot be read as a JSON schema ({schema!r:.40}): "
                         f"{exc}") from exc


def constraint_for(response_format: Any) -> JsonSchema | JsonObject | None:
    """OpenAI-style ``response_format`` -> the engine's grammar constraint."""
    if response_format is None:
        return None
    if isinstance(response_format, JsonSchema | JsonObject):
        return response_format
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        return JsonSchema(json_schema_of(response_format))
    if not isinstance(response_format, Mapping):
        raise ValueError(f"unsupported response_format {response_format!r}")
    kind = response_format.get("type")
    if kind == "json_object":
        return JsonObject()
    if kind == "json_schema":
        spec = response_format.get("json_schema", {})
        schema = spec.get("schema", spec) if isinstance(spec, Mapping) else spec
        return JsonSchema(json_schema_of(schema))
    if kind == "text":
        return None
    raise ValueError(f"response_format type must be json_schema, json_object or text, "
                     f"got {kind!r}")


