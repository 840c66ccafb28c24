"""LangChain's ``ChatAnthropic`` (langchain-anthropic, unchanged) on the Messages door over
loopback, on the tiny random-weight model: invoke and stream equal the engine's own answer,
a forced tool is a valid call, both structured-output methods (a forced tool, and
``output_config.format``) parse, a tool round trip and a ``create_agent`` run complete."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from engine import ChatRequest, Engine, SamplingParams
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(180)
langchain_anthropic = pytest.importorskip("langchain_anthropic")


@tool
def pick(colour: Literal["red", "blue"]) -> str:
    """Pick a colour."""
    return f"picked {colour}"


class Pick(BaseModel):
    """A colour choice."""

    colour: Literal["red", "blue"]


def chat_anthropic(server: LiveServer, **kw: Any) -> Any:
    return langchain_anthropic.ChatAnthropic(model="tiny", base_url=server.url,
                                             api_key="unused", max_retries=0, timeout=60, **kw)


def test_invoke_and_stream_are_the_engine_s_own_answer(live_server: LiveServer,
                                                       server_engine: Engine) -> None:
    llm = chat_anthropic(live_server, max_tokens=8)
    message = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hello")])
    own = server_engine.submit(ChatRequest.from_openai(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        SamplingParams(max_tokens=8))).result(timeout=60)
    assert isinstance(message, AIMessage) and message.text == own.content
    assert message.response_metadata["stop_reason"] == "max_tokens"
    usage = message.usage_metadata
    assert usage is not None and usage["output_tokens"] == 8
    assert usage["input_tokens"] == own.usage.prompt_tokens  # cache reads included
    chunks = list(llm.stream([SystemMessage("Be brief."), HumanMessage("Hello")]))
    assert "".join(c.text for c in chunks) == message.text
    streamed = sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata)
    assert streamed == 8


async def test_async_invoke_equals_invoke(live_server: LiveServer) -> None:
    llm = chat_anthropic(live_server, max_tokens=8)
    assert (await llm.ainvoke("Hello")).text == llm.invoke("Hello").text
    chunks = [chunk async for chunk in llm.astream("Hello")]
    assert "".join(c.text for c in chunks) == llm.invoke("Hello").text


def test_a_forced_tool_is_a_valid_call_and_its_result_is_answered(
        live_server: LiveServer) -> None:
    llm = chat_anthropic(live_server, max_tokens=80)
    forced = llm.bind_tools([pick], tool_choice="pick")
    history: list[Any] = [HumanMessage("Choose a colour.")]
    first = forced.invoke(history)
    assert isinstance(first, AIMessage) and first.tool_calls
    call = first.tool_calls[0]
    assert call["name"] == "pick" and call["args"]["colour"] in ("red", "blue")
    assert first.response_metadata["stop_reason"] == "tool_use"
    streamed = list(forced.stream(history))
    whole: Any = streamed[0]
    for chunk in streamed[1:]:
        whole = whole + chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [
        (c["name"], c["args"]) for c in first.tool_calls]
    history += [first, ToolMessage(pick.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([pick]).invoke(history)
    assert isinstance(answer, AIMessage) and answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]  # type: ignore[index]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_by_either_method(live_server: LiveServer, method: str) -> None:
    llm = chat_anthropic(live_server, max_tokens=60).with_structured_output(Pick,
                                                                            method=method)
    assert isinstance(llm.invoke("Pick a colour."), Pick)


def test_create_agent_runs_to_a_structured_answer(live_server: LiveServer,
                                                  server_engine: Engine) -> None:
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ToolStrategy

    # tool_call_limit (this server's, as extra_body): once pick is answered, a required
    # call may only be the structured answer, so a random-weight model's run ends.
    model = chat_anthropic(live_server, max_tokens=80,
                           model_kwargs={"extra_body": {"tool_call_limit": 1}})
    before = server_engine.stats().completed
    agent = create_agent(model=model, tools=[pick], response_format=ToolStrategy(Pick))
    state = agent.invoke({"messages": [("user", "Pick a colour for me.")]},
                         {"recursion_limit": 12})
    assert isinstance(state["structured_response"], Pick)
    assert server_engine.stats().completed > before
