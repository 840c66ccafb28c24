"""Conversions between LangChain's message types and the engine's requests and results.

Pure functions, no model: LangChain messages -> chat dicts (then ``_chat.normalize_messages``),
LangChain tools and tool choices -> the OpenAI format the engine takes, and engine
completions / stream events -> ``AIMessage`` / ``AIMessageChunk``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import (
    BaseCumulativeTransformOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.json import parse_partial_json
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from engine import (
    Completion,
    JsonObject,
    JsonSchema,
    OutputTruncatedError,
    StreamEvent,
    ToolCallDelta,
    Usage,
)
from mlx_providers._chat import content_text, cut_call, cut_json, normalize_messages

REASONING_KEY = "reasoning_content"
PROVIDER = "mlx"
ToolLike = Mapping[str, Any] | type | Callable[..., Any] | BaseTool


# ----- messages in ---------------------------------------------------------------------


def message_dict(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as a plain chat dict (not yet normalised)."""
    item: dict[str, Any] = {"content": message.content}
    if isinstance(message, SystemMessage):
        item["role"] = "system"
    elif isinstance(message, HumanMessage):
        item["role"] = "user"
    elif isinstance(message, AIMessage):
        item["role"] = "assistant"
        # Only parsed calls were executed; invalid ones have no tool result to pair with.
        if message.tool_calls:
            item["tool_calls"] = [dict(call) for call in message.tool_calls]
    elif isinstance(message, ToolMessage):
        item.update(role="tool", tool_call_id=message.tool_call_id, status=message.status)
    elif isinstance(message, FunctionMessage):
        item["role"] = "tool"
    elif isinstance(message, ChatMessage):
        item["role"] = message.role
    else:
        item["role"] = message.type  # "human", "ai", ... are understood by _chat
    if message.name:
        item["name"] = message.name
    return item


def chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """The engine's chat prompt for a LangChain history (any shape an agent produces)."""
    return normalize_messages([message_dict(m) for m in messages])


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


def tool_choice_name(choice: Any, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """LangChain's spellings of tool_choice -> "auto", "none", "required" or a tool name.

    Raises ValueError at bind time for a name that is not among ``tools``.
    """
    if choice is None:
        return None
    if choice is True or choice in ("any", "required"):
        return "required"
    if choice is False:
        return "none"
    if isinstance(choice, Mapping):  # OpenAI {"function": {"name"}} or Anthropic {"name"}
        fn = choice.get("function", choice)
        choice = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(choice, str):
            raise ValueError(f"tool_choice dict must name a tool, got {choice!r}")
    if not isinstance(choice, str):
        raise ValueError(f"tool_choice must be a string, bool or dict, got {choice!r}")
    if choice in ("auto", "none"):
        return choice
    names = [t["function"]["name"] for t in tools]
    if choice not in names:
        raise ValueError(f"tool_choice {choice!r} is not among the bound tools {names}")
    return choice


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


# ----- results out -------------------------------------------------------------------------


def usage_metadata(usage: Usage) -> UsageMetadata:
    """Engine usage -> LangChain usage (cache hits as ``input_token_details.cache_read``)."""
    # ``output_token_details`` is ``NotRequired`` upstream, but langchain-core 1.x spells it
    # ``typing.NotRequired`` (3.11+), which mypy cannot resolve at python_version = 3.10 and so
    # treats as a required ``Any`` key. ``unused-ignore``: under 3.11, or a langchain-core that
    # takes ``NotRequired`` from typing_extensions, there is nothing to ignore.
    metadata: UsageMetadata = {  # type: ignore[typeddict-item, unused-ignore]
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "input_token_details": InputTokenDetails(cache_read=usage.cached_tokens),
    }
    return metadata


def response_metadata(completion: Completion, model_name: str) -> dict[str, Any]:
    """What LangChain callbacks and tracers read: model, provider, finish reason, timings."""
    meta: dict[str, Any] = {"model_name": model_name, "model_provider": PROVIDER,
                            "finish_reason": completion.finish_reason.value}
    if completion.usage.time_to_first_token is not None:
        meta["time_to_first_token"] = completion.usage.time_to_first_token
    if completion.usage.decode_tokens_per_second is not None:
        meta["decode_tokens_per_second"] = completion.usage.decode_tokens_per_second
    return meta


def _reasoning_kwargs(reasoning: str | None) -> dict[str, Any]:
    return {REASONING_KEY: reasoning} if reasoning else {}


def ai_message(completion: Completion, model_name: str) -> AIMessage:
    """A finished request as an ``AIMessage`` with parsed and invalid tool calls."""
    return AIMessage(
        content=completion.content,
        additional_kwargs=_reasoning_kwargs(completion.reasoning),
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id)
                    for c in completion.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.raw, id=c.id, error=c.error)
                            for c in completion.invalid_tool_calls],
        usage_metadata=usage_metadata(completion.usage),
        response_metadata=response_metadata(completion, model_name),
    )


def chat_generation(completion: Completion, model_name: str) -> ChatGeneration:
    return ChatGeneration(message=ai_message(completion, model_name),
                          generation_info={"finish_reason": completion.finish_reason.value})


def _invalid_args(raw: str) -> str:
    # A chunk whose args parse to a dict becomes a valid call when chunks merge, so
    # markup that parses (e.g. cut off mid-object) is passed on quoted instead.
    try:
        parses = isinstance(parse_partial_json(raw), dict)
    except Exception:
        parses = False
    return json.dumps(raw) if parses else raw


def call_delta_chunks(deltas: Sequence[ToolCallDelta]) -> list[Any]:
    """The engine's tool-call deltas as ``tool_call_chunks``: LangChain merges them by
    ``index`` (id and name from the first, ``args`` concatenated). The engine streams a call
    only once it keeps it, so a merged stream never shows a call ``invoke`` would not."""
    return [tool_call_chunk(name=d.name, args=d.arguments, id=d.id, index=d.index)
            for d in deltas]


def invalid_call_chunks(completion: Completion) -> list[Any]:
    """The completion's unparsed calls, after its kept ones, for the last chunk."""
    offset = len(completion.tool_calls)
    return [tool_call_chunk(name=c.name, args=_invalid_args(c.raw), id=c.id, index=offset + i)
            for i, c in enumerate(completion.invalid_tool_calls)]


def event_chunk(event: StreamEvent, model_name: str) -> ChatGenerationChunk | None:
    """One engine event as a chunk; None for a step that added nothing to show.

    Tool calls arrive as the engine keeps them; usage, invalid calls and response metadata
    ride on the last chunk only, so that adding chunks together counts tokens once.
    """
    completion = event.completion
    calls = call_delta_chunks(event.tool_call_deltas)
    if completion is None:
        if not event.content and not event.reasoning and not calls:
            return None
        return ChatGenerationChunk(message=AIMessageChunk(
            content=event.content, additional_kwargs=_reasoning_kwargs(event.reasoning),
            tool_call_chunks=calls))
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content=event.content,
            additional_kwargs=_reasoning_kwargs(event.reasoning),
            tool_call_chunks=calls + invalid_call_chunks(completion),
            usage_metadata=usage_metadata(completion.usage),
            response_metadata=response_metadata(completion, model_name),
            chunk_position="last",
        ),
        generation_info={"finish_reason": completion.finish_reason.value},
    )


# ----- structured output ----------------------------------------------------------------------


class TruncatedOutputError(OutputTruncatedError, OutputParserException):
    """``OutputTruncatedError`` as LangChain's parsers raise errors: an
    ``OutputParserException``, so ``include_raw`` and agents' parsing-error handling see it."""

    def __init__(self, cut: OutputTruncatedError, llm_output: str) -> None:
        super().__init__(cut.max_tokens, cut.completion_tokens, cut.what)
        self.llm_output = llm_output


def truncation_error(result: Sequence[Generation], *,
                     tool_output: bool) -> TruncatedOutputError | None:
    """The error for a structured reply that ``max_tokens`` cut, else None.

    Read from the (possibly merged, streamed) message: its ``finish_reason`` is "length"
    and the JSON is not whole, or (``tool_output``) the forced call was not closed.
    Before the last streamed chunk there is no finish reason, so partial output passes.
    """
    message = getattr(result[0], "message", None) if result else None
    if not isinstance(message, AIMessage):
        return None
    finish = message.response_metadata.get("finish_reason")
    tokens = message.usage_metadata["output_tokens"] if message.usage_metadata else 0
    text = content_text(message.content)
    if tool_output:
        cut = cut_call(finish, len(message.tool_calls), len(message.invalid_tool_calls), tokens)
    else:
        cut = cut_json(finish, text, tokens)
    if cut is None:
        return None
    raw = text or json.dumps([dict(c) for c in message.invalid_tool_calls], default=str)
    return TruncatedOutputError(cut, raw)


class TruncationCheckedParser(BaseCumulativeTransformOutputParser[Any]):
    """``inner``, but a reply cut at ``max_tokens`` raises ``TruncatedOutputError`` instead of
    a field-level parse error (or, for a cut call, a silent None). Streams like ``inner``."""

    inner: Any
    tool_output: bool = False

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        error = truncation_error(result, tool_output=self.tool_output)
        if error is not None:
            raise error
        return self.inner.parse_result(result, partial=partial)

    def parse(self, text: str) -> Any:
        return self.inner.parse(text)

    @property
    def _type(self) -> str:
        return "mlx_truncation_checked"


def structured_parser(schema: Mapping[str, Any] | type | None, *,
                      tool_output: bool) -> Runnable[Any, Any]:
    """What turns a structured-output reply into ``schema``: a pydantic instance for
    pydantic schemas (v1 or v2), else a dict; read from the forced tool call when
    ``tool_output``, else from the JSON text. A reply cut at ``max_tokens`` raises
    ``TruncatedOutputError`` (an ``OutputTruncatedError`` and ``OutputParserException``)."""
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    inner: Runnable[Any, Any]
    if tool_output:
        if is_pydantic:
            inner = PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
        else:
            name = convert_to_openai_tool(schema)["function"]["name"]  # type: ignore[arg-type]
            inner = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    elif is_pydantic:
        inner = PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
    else:
        inner = JsonOutputParser()
    return TruncationCheckedParser(inner=inner, tool_output=tool_output)


def with_raw(llm: Runnable[Any, Any], parser: Runnable[Any, Any]) -> Runnable[Any, Any]:
    """``{"raw", "parsed", "parsing_error"}``: a parsing error is returned, not raised."""
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                        parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback],
                                                          exception_key="parsing_error")
