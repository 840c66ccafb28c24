"""Validation at both adapters' doors, without a model: what no agent produces is a
TypeError or ValueError naming the argument, never an AttributeError from inside.

Every call here fails before a request is submitted, so the models named never load.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage as LIChatMessage
from llama_index.core.base.llms.types import MessageRole
from pydantic import BaseModel

from engine import InvalidRequestError, messages_from_openai
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from mlx_providers._langchain_inbound import json_schema_of, openai_tools
from mlx_providers._llama_index_inbound import to_engine_messages
from mlx_providers._llama_index_structured import json_kwargs

NOWHERE = "/nonexistent/validation-model"  # never loaded: every call fails at the door
HI = [LIChatMessage(role=MessageRole.USER, content="hi")]


class Answer(BaseModel):
    value: int


# ----- the engine's one rulebook (every door goes through it: engine, adapters, server) ---

@pytest.mark.parametrize(("messages", "kind", "match"), [
    ("hi", TypeError, "messages must be a list"),
    ({"role": "user"}, TypeError, "messages must be a list"),
    ([5], TypeError, r"messages\[0\] must be a chat message"),
    ([{"role": "wizard", "content": "x"}], ValueError, r"messages\[0\]\.role"),
    ([{"role": None, "content": "x"}], ValueError, r"messages\[0\]\.role"),
    ([{"role": 3, "content": "x"}], ValueError, r"messages\[0\]\.role"),
    ([{"content": "x"}], ValueError, r"messages\[0\]\.role"),
    ([{"role": "user", "content": b"x"}], TypeError, r"messages\[0\]\.content"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\.content"),
    ([{"role": "user", "content": [None]}], TypeError, r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], TypeError,
     r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": 5}]}], TypeError, r"content\[0\]\.type"),
    ([{"role": "tool", "content": "r", "tool_call_id": 5}], TypeError,
     r"messages\[0\]\.tool_call_id"),
    ([{"role": "user", "content": "x", "name": 5}], TypeError, r"messages\[0\]\.name"),
    ([{"role": "assistant", "content": "", "tool_calls": 5}], TypeError,
     r"messages\[0\]\.tool_calls must be a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [5]}], TypeError,
     r"tool_calls\[0\] must be a tool call"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": 5}]}], TypeError,
     r"tool_calls\[0\]\.function"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": ""}]}], ValueError,
     r"tool_calls\[0\]: a tool call needs"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "id": 1}]}],
     TypeError, r"tool_calls\[0\]\.id"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "args": 5}]}],
     TypeError, r"tool_calls\[0\]: arguments"),
])
def test_the_rulebook_names_what_is_wrong(messages: Any, kind: type[BaseException],
                                          match: str) -> None:
    # Was _chat.normalize_messages (adapters and server); the engine's rulebook replaced it.
    with pytest.raises(kind, match=match):
        messages_from_openai(messages)


def test_content_keeps_text_drops_silent_assistant_parts_and_refuses_media() -> None:
    # Rulebook change: media parts were dropped by the adapters; every door refuses them now.
    parts = ["a", {"type": "text", "text": "b"}, {"type": "reasoning", "reasoning": "r"},
             {"type": "output_text", "text": "c"}]
    [message] = messages_from_openai([{"role": "assistant", "content": parts}])
    assert message.content == "abc"
    assert message.extra["reasoning_content"] == "r"  # replayed as the turn's reasoning
    [empty] = messages_from_openai([{"role": "assistant", "content": None}])
    assert empty.content == ""
    audio = {"type": "input_audio", "input_audio": {"data": ""}}
    with pytest.raises(InvalidRequestError, match="not readable audio") as caught:
        messages_from_openai([{"role": "user", "content": ["a", audio]}])
    assert caught.value.field == "messages[0].content[1]"


def test_reasoning_parts_replay_unless_the_turn_says_its_reasoning() -> None:
    parts = [{"type": "thinking", "thinking": "one, "}, {"type": "reasoning", "text": "two"},
             {"type": "text", "text": "answer"}]
    [turn] = messages_from_openai([{"role": "assistant", "content": parts}])
    assert (turn.content, turn.extra["reasoning_content"]) == ("answer", "one, two")
    [said] = messages_from_openai([{"role": "assistant", "content": parts,
                                    "reasoning_content": "kept"}])
    assert said.extra["reasoning_content"] == "kept"
    [plain] = messages_from_openai([{"role": "assistant", "content": "answer"}])
    assert "reasoning_content" not in plain.extra


# ----- LlamaIndex ---------------------------------------------------------------------------

def test_llama_index_messages_must_be_chat_messages() -> None:
    with pytest.raises(TypeError, match=r"messages\[0\] must be a llama_index ChatMessage"):
        to_engine_messages([{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="messages must be a list"):
        to_engine_messages("hi")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="messages must be a list"):
        to_engine_messages(HI[0])  # type: ignore[arg-type]


def test_llama_index_structured_output_needs_a_pydantic_class() -> None:
    with pytest.raises(TypeError, match="output_cls must be a pydantic BaseModel subclass"):
        json_kwargs(int, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="llm_kwargs must be a dict"):
        json_kwargs(Answer, [1])  # type: ignore[arg-type]
    assert "constraint" in json_kwargs(Answer, {"max_tokens": 5})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"timeout": math.inf}, "timeout"), ({"timeout": 0}, "timeout"),
    ({"temperature": -1}, "temperature"), ({"seed": -1}, "seed"),
    ({"engine_config": "x"}, "engine_config"), ({"engine_config": {"max_batch": "4"}}, "max_batch"),
    ({"stop": "END"}, "stop"),
])
def test_llama_index_constructor_names_bad_fields(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MLXBatchLLM(NOWHERE, **kwargs)


# ----- LangChain ---------------------------------------------------------------------------

def test_langchain_tools_and_schemas_of_the_wrong_kind_are_named() -> None:
    with pytest.raises(TypeError, match=r"tools\[0\] must be a LangChain tool"):
        openai_tools([5])
    with pytest.raises(TypeError, match="tools must be a list"):
        openai_tools("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schema must be"):
        json_schema_of(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schema cannot be read"):
        json_schema_of(int)


@pytest.fixture(scope="module")
def chat() -> ChatMLXBatch:
    return ChatMLXBatch(model=NOWHERE, max_tokens=4)


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": 5}}}


@pytest.mark.parametrize(("call", "kind", "match"), [
    (lambda c: c.invoke([ChatMessage(role="wizard", content="x")]), ValueError,
     r"messages\[0\]\.role"),
    (lambda c: c.invoke([HumanMessage(content=[{"type": "text", "text": 5}])]), TypeError,
     r"messages\[0\]\.content\[0\]"),
    (lambda c: c.invoke([HumanMessage("hi"), AIMessage("", tool_calls=[
        {"name": "f", "args": {}, "id": "1"}]), ToolMessage(content=[{"type": "text", "text": 5}],
                                                            tool_call_id="1")]),
     TypeError, r"messages\[2\]\.content\[0\]"),
    (lambda c: c.invoke("hi", tools="abc"), TypeError, "tools must be a list"),
    (lambda c: c.bind_tools([BAD_TOOL]).invoke("hi"), ValueError,
     r"tools\[0\]\.function\.parameters\.properties"),
    (lambda c: c.bind_tools([5]), TypeError, r"tools\[0\]"),
    (lambda c: c.bind_tools([BAD_TOOL], tool_choice=5), ValueError, "tool_choice"),
    (lambda c: c.with_structured_output(5), TypeError, "schema must be"),
    (lambda c: c.with_structured_output("abc"), TypeError, "schema must be"),
    (lambda c: c.invoke("hi", stop=5), ValueError, "SamplingParams.stop"),
    (lambda c: c.invoke("hi", timeout="x"), TypeError, "timeout"),
    (lambda c: c.invoke("hi", model=5), TypeError, "model must be"),
    (lambda c: c.invoke("hi", chat_template_kwargs="x"), TypeError, "chat_template_kwargs"),
    (lambda c: c.invoke("hi", reasoning="yes"), TypeError, "reasoning"),
    (lambda c: c.invoke("hi", parallel_tool_calls="no"), TypeError, "parallel_tool_calls"),
    (lambda c: c.invoke("hi", constraint="x"), ValueError, "SamplingParams.constraint"),
    (lambda c: c.invoke("hi", response_format="json"), ValueError, "response_format"),
    (lambda c: c.invoke("hi", response_format={"type": "json_schema", "json_schema": 5}),
     TypeError, "schema must be"),
    (lambda c: c.invoke("hi", seed=2**64), ValueError, "SamplingParams.seed"),
    # LangChain's coercion raised NotImplementedError for these (found by fuzzing).
    (lambda c: c.invoke([(None,)]), TypeError, "input must be"),
    (lambda c: c.invoke([b""]), TypeError, "input must be"),
    # ...and a bare KeyError for message dicts missing a key they require (fuzzing again).
    (lambda c: c.invoke([{"role": "tool", "content": "x"}]), ValueError, "tool_call_id"),
    (lambda c: c.invoke([{"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]),
     ValueError, "missing the key"),
])
def test_langchain_calls_name_bad_arguments(chat: ChatMLXBatch, call: Any,
                                            kind: type[BaseException], match: str) -> None:
    with pytest.raises(kind, match=match):
        call(chat)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": "hot"}, "temperature"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"seed": -1}, "seed"), ({"top_k": 2**31}, "top_k"), ({"stop": [""]}, "stop"),
    ({"engine_config": [1]}, "engine_config"), ({"engine_config": {"max_batch": 4.0}}, "max_batch"),
    ({"timeout": math.inf}, "timeout"),
])
def test_langchain_constructor_names_bad_fields(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChatMLXBatch(model=NOWHERE, **kwargs)
