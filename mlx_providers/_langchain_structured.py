"""Structured output for ``with_structured_output``: the parsers, a cut output raised as
``OutputTruncatedError`` (also an ``OutputParserException``), replies that called a tool,
and ``include_raw``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
)
from langchain_core.output_parsers import (
    BaseCumulativeTransformOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import Generation
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from engine import (
    OutputTruncatedError,
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
