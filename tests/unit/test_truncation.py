"""Outputs cut at max_tokens, and tool_calls as a finish reason, in both adapters (no model).

Structured output cut at ``max_tokens`` and forced calls cut mid-arguments raise
``engine.OutputTruncatedError`` naming the limit, never a field-level parse error; with
LangChain's ``include_raw`` the error comes back as ``parsing_error``. The engine decides
what was cut (``Completion.truncated``, from ``engine.requests.outbound.results.truncation``); the
adapters only raise from it, so the adapter inputs here carry the engine's word.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.runnables import RunnableLambda
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from pydantic import BaseModel

from engine import (
    ChatRequest,
    Completion,
    FinishReason,
    InvalidToolCall,
    JsonObject,
    OutputTruncatedError,
    StreamEvent,
    ToolCall,
    Usage,
)
from engine.requests.outbound.results import FORCED_CALL, STRUCTURED_JSON, truncation
from mlx_providers._langchain_outbound import ai_message, event_chunk
from mlx_providers._langchain_structured import TruncatedOutputError, structured_parser, with_raw
from mlx_providers._llama_index_outbound import StreamChunks, chat_response
from mlx_providers._llama_index_structured import check_structured_chunk, parse_structured


class Forecast(BaseModel):
    city: str
    days: int


CALL = ToolCall("c1", "Forecast", {"city": "Oslo", "days": 2})
OPEN_CALL = InvalidToolCall("c2", None, '{"name": "Forecast", "arguments": {"ci',
                            "the tool call was not closed")


def completion(finish: FinishReason = FinishReason.LENGTH, tokens: int = 8,
               **kw: Any) -> Completion:
    fields: dict[str, Any] = {"text": "", "token_ids": tuple(range(tokens)),
                              "finish_reason": finish, "usage": Usage(5, tokens)}
    return Completion(**{**fields, **kw})


# ----- the shared rules -----------------------------------------------------------------------


def test_the_error_names_max_tokens_and_what_was_reached() -> None:
    error = OutputTruncatedError(32, 32)
    assert isinstance(error, ValueError)
    assert str(error) == ("the output was cut at max_tokens=32 after 32 tokens before it "
                          "was complete; raise max_tokens")
    assert (error.max_tokens, error.completion_tokens) == (32, 32)


def test_forced_choices() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]

    def forces_call(tools: Any, choice: Any) -> bool:
        return ChatRequest.from_openai([{"role": "user", "content": "q"}], tools=tools,
                                       tool_choice=choice).forces_call

    assert forces_call(tools, "required") and forces_call(tools, "f")
    assert forces_call(tools, {"type": "function", "function": {"name": "f"}})
    assert not forces_call(tools, "auto") and not forces_call(tools, "none")
    assert not forces_call(tools, None) and not forces_call(None, "auto")
    # "required" without tools is refused by the rulebook (it used to read as not forcing).
    with pytest.raises(ValueError, match="needs at least one tool"):
        forces_call(None, "required")


def cut_json(finish: FinishReason, text: str) -> str | None:
    return truncation(finish, False, JsonObject(), text, 0, 0)


def cut_call(finish: FinishReason, calls: int, invalid: int) -> str | None:
    return truncation(finish, True, None, "", calls, invalid)


def test_json_is_cut_only_when_length_left_it_incomplete() -> None:
    assert cut_json(FinishReason.LENGTH, '{"city": "Os') is not None
    assert cut_json(FinishReason.LENGTH, '{"city": "Oslo", "days": 2}') is None  # done at limit
    assert cut_json(FinishReason.STOP, '{"city": "Os') is None
    assert cut_json(FinishReason.LENGTH, "") is not None
    assert truncation(FinishReason.LENGTH, False, None, '{"ci', 0, 0) is None  # not strict JSON


def test_a_forced_call_is_cut_when_one_is_left_open_or_none_was_made() -> None:
    assert cut_call(FinishReason.LENGTH, 0, 1) is not None
    assert cut_call(FinishReason.LENGTH, 0, 0) is not None
    assert cut_call(FinishReason.LENGTH, 2, 1) is not None
    assert cut_call(FinishReason.LENGTH, 1, 0) is None  # closed exactly at the limit
    assert cut_call(FinishReason.TOOL_CALLS, 1, 0) is None
    error = completion(invalid_tool_calls=(OPEN_CALL,), truncated=FORCED_CALL).truncation_error()
    assert error is not None and "forced tool call" in str(error)
    assert "max_tokens=8" in str(error)


# ----- LangChain ------------------------------------------------------------------------------


def lc_message(content: str = "", finish: str = "length", **kw: Any) -> AIMessage:
    # The engine's word, as ai_message puts it into response_metadata.
    cut = {"truncated": STRUCTURED_JSON} if finish == "length" and not whole(content) else {}
    return AIMessage(content=content, response_metadata={"finish_reason": finish, **cut},
                     usage_metadata={"input_tokens": 5, "output_tokens": 8, "total_tokens": 13},
                     **kw)


def whole(text: str) -> bool:
    return cut_json(FinishReason.LENGTH, text) is None


@pytest.mark.parametrize("schema", [Forecast, Forecast.model_json_schema(), None],
                         ids=["pydantic", "json_schema", "json_mode"])
def test_langchain_structured_json_cut_raises_the_truncation_error(schema: Any) -> None:
    parser = structured_parser(schema, tool_output=False)
    with pytest.raises(OutputTruncatedError, match=r"max_tokens=8 after 8 tokens") as caught:
        parser.invoke(lc_message('{"city": "Oslo", "da'))
    assert isinstance(caught.value, OutputParserException)
    assert isinstance(caught.value, TruncatedOutputError)
    assert caught.value.llm_output == '{"city": "Oslo", "da'
    whole = parser.invoke(lc_message('{"city": "Oslo", "days": 2}'))
    assert whole == Forecast(city="Oslo", days=2) or whole == {"city": "Oslo", "days": 2}


@pytest.mark.parametrize("schema", [Forecast, Forecast.model_json_schema()],
                         ids=["pydantic", "json_schema"])
def test_langchain_function_calling_cut_raises_instead_of_returning_none(schema: Any) -> None:
    parser = structured_parser(schema, tool_output=True)
    cut = ai_message(completion(invalid_tool_calls=(OPEN_CALL,), truncated=FORCED_CALL), "m")
    with pytest.raises(OutputTruncatedError, match="forced tool call was cut at max_tokens=8"):
        parser.invoke(cut)
    done = ai_message(completion(tool_calls=(CALL,)), "m")  # closed exactly at the limit
    parsed = parser.invoke(done)
    assert parsed == Forecast(city="Oslo", days=2) or parsed == {"city": "Oslo", "days": 2}


def test_langchain_include_raw_returns_the_truncation_as_parsing_error() -> None:
    cut = lc_message('{"city": "Os')
    chain = with_raw(RunnableLambda(lambda _: cut), structured_parser(Forecast, tool_output=False))
    result = chain.invoke("Forecast?")
    assert result["raw"] is cut and result["parsed"] is None
    assert isinstance(result["parsing_error"], OutputTruncatedError)
    assert "max_tokens=8" in str(result["parsing_error"])


def test_langchain_streamed_structured_output_raises_at_the_cut_chunk() -> None:
    parser = structured_parser(None, tool_output=False)
    chunks = [AIMessageChunk(content='{"city": '), AIMessageChunk(content='"Os'),
              AIMessageChunk(content="", response_metadata={"finish_reason": "length",
                                                            "truncated": STRUCTURED_JSON},
                             usage_metadata={"input_tokens": 5, "output_tokens": 3,
                                             "total_tokens": 8})]
    seen: list[Any] = []
    with pytest.raises(OutputTruncatedError, match="max_tokens=3"):
        for item in parser.transform(iter(chunks)):
            seen.append(item)
    assert seen and seen[-1] == {"city": "Os"}  # partial objects streamed before the cut


def test_langchain_finish_reason_is_tool_calls_when_the_answer_holds_calls() -> None:
    done = completion(FinishReason.TOOL_CALLS, tool_calls=(CALL,))
    assert ai_message(done, "m").response_metadata["finish_reason"] == "tool_calls"
    chunk = event_chunk(StreamEvent("", (), finish_reason=FinishReason.TOOL_CALLS,
                                    usage=done.usage, completion=done), "m")
    assert chunk is not None and chunk.generation_info == {"finish_reason": "tool_calls"}
    assert chunk.message.response_metadata["finish_reason"] == "tool_calls"


# ----- LlamaIndex -----------------------------------------------------------------------------


def li_response(content: str, finish: FinishReason = FinishReason.LENGTH) -> ChatResponse:
    cut = cut_json(finish, content)  # the engine's word, as rows.final sets it
    return chat_response(completion(finish, content=content, truncated=cut), "m")


def test_llama_index_structured_cut_raises_the_truncation_error() -> None:
    with pytest.raises(OutputTruncatedError, match="JSON for Forecast was cut at max_tokens=8"):
        parse_structured(Forecast, li_response('{"city": "Os'))
    assert parse_structured(Forecast, li_response('{"city": "Oslo", "days": 2}')) == Forecast(
        city="Oslo", days=2)
    with pytest.raises(ValueError, match="did not validate") as caught:
        parse_structured(Forecast, li_response('{"city": "Oslo"}', FinishReason.STOP))
    assert not isinstance(caught.value, OutputTruncatedError)


def test_llama_index_streamed_structured_chunks_raise_only_at_the_cut() -> None:
    partial = ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content='{"ci'),
                           delta='{"ci')
    check_structured_chunk(Forecast, partial)  # no finish reason yet: passes
    with pytest.raises(OutputTruncatedError):
        check_structured_chunk(Forecast, li_response('{"city": "Os'))


def test_llama_index_stream_checks_the_final_completion() -> None:
    def check(done: Completion) -> Completion:
        error = done.truncation_error()
        if error is not None:
            raise error
        return done

    chunks = StreamChunks("m", check)
    cut = completion(invalid_tool_calls=(OPEN_CALL,), truncated=FORCED_CALL)
    with pytest.raises(OutputTruncatedError, match="forced tool call"):
        chunks.chat(StreamEvent("", (), finish_reason=FinishReason.LENGTH, completion=cut))
    done = completion(FinishReason.TOOL_CALLS, tool_calls=(CALL,))
    last = chunks.chat(StreamEvent("", (), finish_reason=FinishReason.TOOL_CALLS,
                                   completion=done))
    assert last is not None and last.raw["finish_reason"] == "tool_calls"


def test_tools_beside_json_that_took_the_call_branch_are_cut_by_an_open_call() -> None:
    """Issue 37's reply: one call closed, a second cut by max_tokens. What was cut is a
    call, not the JSON answer the request also allowed."""
    assert truncation(FinishReason.LENGTH, False, JsonObject(), "", 1, 1) == "a tool call"
    assert truncation(FinishReason.LENGTH, False, JsonObject(), "", 0, 1) == "a tool call"
    assert truncation(FinishReason.LENGTH, False, JsonObject(), "", 2, 0) is None
    assert truncation(FinishReason.TOOL_CALLS, False, JsonObject(), "", 1, 0) is None
