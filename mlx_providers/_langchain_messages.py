"""Conversions between LangChain's message types and the engine's requests and results.

Pure functions, no model: LangChain messages -> the engine's ``Message`` values (through
its one rulebook, ``engine.messages_from_openai``), LangChain tools and tool choices -> the
engine's ``ToolSpec`` values and resolved choice, and engine completions / stream events ->
``AIMessage`` / ``AIMessageChunk``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
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
from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import (
    BaseCumulativeTransformOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, Generation
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.json import parse_partial_json
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from engine import (
    Completion,
    FinishReason,
    InvalidRequestError,
    JsonObject,
    JsonSchema,
    Message,
    OutputTruncatedError,
    StreamEvent,
    ToolCallDelta,
    ToolSpec,
    Usage,
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


# ----- results out -------------------------------------------------------------------------


def usage_metadata(usage: Usage) -> UsageMetadata:
    """Engine usage, renamed for LangChain (cache hits as ``input_token_details.cache_read``,
    tokens spent reasoning as ``output_token_details.reasoning``)."""
    counts = usage.as_dict()
    # ``output_token_details`` is ``NotRequired`` upstream, but langchain-core 1.x spells it
    # ``typing.NotRequired`` (3.11+), which mypy cannot resolve at python_version = 3.10 and so
    # treats as a required ``Any`` key. ``unused-ignore``: under 3.11, or a langchain-core that
    # takes ``NotRequired`` from typing_extensions, there is nothing to ignore.
    metadata: UsageMetadata = {  # type: ignore[typeddict-item, unused-ignore]
        "input_tokens": counts["prompt_tokens"],
        "output_tokens": counts["completion_tokens"],
        "total_tokens": counts["total_tokens"],
        "input_token_details": InputTokenDetails(cache_read=counts["cached_tokens"]),
        "output_token_details": OutputTokenDetails(reasoning=counts["reasoning_tokens"]),
    }
    return metadata


# langchain-core (1.8.4+) reads ``normalized_finish_reason`` beside the provider's raw one,
# in its own vocabulary ("tool_call", singular; it corrects "stop" with calls itself).
NORMALIZED = {FinishReason.STOP: "stop", FinishReason.TOOL_CALLS: "tool_call",
              FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled",
              FinishReason.ERROR: "error"}


# OpenAI's ``logprobs`` object (``engine.openai_logprobs``) or None: where ChatOpenAI puts
# it, ``response_metadata["logprobs"]`` (and ``generation_info``, which LangChain copies
# there). A streamed chunk carries its own tokens': LangChain concatenates the lists when
# chunks are added, so a merged stream's equal the whole answer's.
Logprobs = dict[str, Any] | None


def response_metadata(completion: Completion, model_name: str,
                      logprobs: Logprobs = None) -> dict[str, Any]:
    """What LangChain callbacks and tracers read: model, provider, finish reason, timings,
    and the logprobs when they were asked for."""
    meta: dict[str, Any] = {"model_name": model_name, "model_provider": PROVIDER,
                            "finish_reason": completion.finish_reason.value,
                            "normalized_finish_reason": NORMALIZED[completion.finish_reason]}
    if logprobs is not None:
        meta["logprobs"] = logprobs
    if completion.truncated is not None:  # the engine's word: max_tokens cut what had to be whole
        meta["truncated"] = completion.truncated
    if completion.usage.time_to_first_token is not None:
        meta["time_to_first_token"] = completion.usage.time_to_first_token
    if completion.usage.decode_tokens_per_second is not None:
        meta["decode_tokens_per_second"] = completion.usage.decode_tokens_per_second
    return meta


def _reasoning_kwargs(reasoning: str | None) -> dict[str, Any]:
    return {REASONING_KEY: reasoning} if reasoning else {}


def ai_message(completion: Completion, model_name: str, logprobs: Logprobs = None) -> AIMessage:
    """A finished request as an ``AIMessage`` with parsed and invalid tool calls."""
    return AIMessage(
        content=completion.content,
        additional_kwargs=_reasoning_kwargs(completion.reasoning),
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id)
                    for c in completion.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.raw, id=c.id, error=c.error)
                            for c in completion.invalid_tool_calls],
        usage_metadata=usage_metadata(completion.usage),
        response_metadata=response_metadata(completion, model_name, logprobs),
    )


def _generation_info(finish_reason: FinishReason | None, logprobs: Logprobs) -> dict[str, Any]:
    info: dict[str, Any] = {} if finish_reason is None else {"finish_reason": finish_reason.value}
    if logprobs is not None:
        info["logprobs"] = logprobs
    return info


def chat_generation(completion: Completion, model_name: str,
                    logprobs: Logprobs = None) -> ChatGeneration:
    return ChatGeneration(message=ai_message(completion, model_name, logprobs),
                          generation_info=_generation_info(completion.finish_reason, logprobs))


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
    ``index`` (id and name from the first, ``args`` fragments concatenated). The engine
    holds back a call it may still drop, so a merged stream never shows a call ``invoke``
    would drop; a call cut by the row's end was sent as far as it was written (as with
    ChatOpenAI), which ``invoke`` lists in ``invalid_tool_calls``."""
    merged: list[ToolCallDelta] = []  # one chunk per call and step: LangChain merges
    for d in deltas:                  # same-index entries across chunks, not within one
        last = merged[-1] if merged else None
        if last is not None and last.index == d.index and d.id is None:
            merged[-1] = ToolCallDelta(d.index, last.id, last.name, last.arguments + d.arguments)
        else:
            merged.append(d)
    return [tool_call_chunk(name=d.name, args=d.arguments, id=d.id, index=d.index)
            for d in merged]


def invalid_call_chunks(completion: Completion) -> list[Any]:
    """The completion's unparsed calls that were never streamed, after every streamed
    call, for the last chunk (a streamed one's pieces went out already)."""
    unsent = [c for c in completion.invalid_tool_calls if c.index is None]
    offset = len(completion.tool_calls) + len(completion.invalid_tool_calls) - len(unsent)
    return [tool_call_chunk(name=c.name, args=_invalid_args(c.raw), id=c.id, index=offset + i)
            for i, c in enumerate(unsent)]


def event_chunk(event: StreamEvent, model_name: str,
                logprobs: Logprobs = None) -> ChatGenerationChunk | None:
    """One engine event as a chunk; None for a step that added nothing to show.

    Tool calls arrive as the engine keeps them; usage, invalid calls and response metadata
    ride on the last chunk only, so that adding chunks together counts tokens once.
    ``logprobs`` are the event's own tokens' (a token whose text is held back, or is
    tool-call markup, still brings its logprob: the chunk then has no content).
    """
    completion = event.completion
    calls = call_delta_chunks(event.tool_call_deltas)
    if completion is None:
        has_logprobs = bool(logprobs and logprobs["content"])
        if not event.content and not event.reasoning and not calls and not has_logprobs:
            return None
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=event.content, additional_kwargs=_reasoning_kwargs(event.reasoning),
                tool_call_chunks=calls,
                response_metadata={"logprobs": logprobs} if has_logprobs else {}),
            generation_info=_generation_info(None, logprobs) if has_logprobs else None)
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content=event.content,
            additional_kwargs=_reasoning_kwargs(event.reasoning),
            tool_call_chunks=calls + invalid_call_chunks(completion),
            usage_metadata=usage_metadata(completion.usage),
            response_metadata=response_metadata(completion, model_name, logprobs),
            chunk_position="last",
        ),
        generation_info=_generation_info(completion.finish_reason, logprobs),
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

    Read from the (possibly merged, streamed) message's ``response_metadata["truncated"]``,
    which the engine's completion sets (``Completion.truncated``); before the last streamed
    chunk there is none, so partial output passes. ``tool_output`` says what the parser
    reads; the engine has said already whether that was cut.
    """
    message = getattr(result[0], "message", None) if result else None
    if not isinstance(message, AIMessage):
        return None
    what = message.response_metadata.get("truncated")
    if not isinstance(what, str):
        return None
    tokens = message.usage_metadata["output_tokens"] if message.usage_metadata else 0
    text = message.content if isinstance(message.content, str) else message.text
    raw = text or json.dumps([dict(c) for c in message.invalid_tool_calls], default=str)
    return TruncatedOutputError(OutputTruncatedError(tokens, tokens, what), raw)


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


def unless_called(parser: Runnable[Any, Any]) -> Runnable[Any, Any]:
    """``parser`` for an answer; None for a reply that calls a tool instead (tools beside a
    schema: the caller runs the calls and asks again)."""

    def parse(message: BaseMessage) -> Any:
        if isinstance(message, AIMessage) and message.tool_calls:
            return None
        return parser.invoke(message)

    return RunnableLambda(parse)


def with_raw(llm: Runnable[Any, Any], parser: Runnable[Any, Any]) -> Runnable[Any, Any]:
    """``{"raw", "parsed", "parsing_error"}``: a parsing error is returned, not raised."""
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                        parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback],
                                                          exception_key="parsing_error")
