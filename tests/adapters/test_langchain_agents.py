"""LangChain 1.x agents on ChatMLXBatch: ``create_agent`` with tools and a response format,
the requests it sends and how many, on a scripted engine (what the engine does with
such a request, the union grammar, is tested in ``tests/engine/test_tools_or_answer.py``;
the default model runs the same agents in ``tests/real``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy, ToolStrategy
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from engine import FinishReason, JsonSchema, ToolCall
from mlx_providers import ChatMLXBatch
from tests.fake_engine import Reply, Submitted, scripted


class Forecast(BaseModel):
    """A weather forecast."""

    city: str
    sky: str = Field(description="clear or cloudy")


ASKED: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    ASKED.append(city)
    return "cloudy"


CALL = Reply(pieces=(), finish_reason=FinishReason.TOOL_CALLS,
             tool_calls=(ToolCall("call_1", "get_weather", {"city": "Paris"}),))


def _called(call: Submitted) -> bool:
    return any(m.role == "tool" for m in call.prompt.messages)  # type: ignore[union-attr]


def _provider_turns(call: Submitted) -> Reply:
    """The weather tool first, then the schema's answer (what the union grammar allows)."""
    return Reply(pieces=(json.dumps({"city": "Paris", "sky": "cloudy"}),)) if _called(
        call) else CALL


def _tool_strategy_turns(call: Submitted) -> Reply:
    """The weather tool first, then the structured-output tool."""
    if not _called(call):
        return CALL
    return Reply(pieces=(), finish_reason=FinishReason.TOOL_CALLS, tool_calls=(
        ToolCall("call_2", "Forecast", {"city": "Paris", "sky": "cloudy"}),))


@pytest.mark.parametrize("strategy", ["auto", "provider"])
def test_provider_strategy_sends_tools_and_the_schema_in_one_request(strategy: str) -> None:
    ASKED.clear()
    response_format: Any = Forecast if strategy == "auto" else ProviderStrategy(Forecast)
    with scripted(f"agent-{strategy}", _provider_turns) as fake:
        agent = create_agent(model=ChatMLXBatch(model=f"agent-{strategy}"),
                             tools=[get_weather], response_format=response_format)
        state = agent.invoke({"messages": [("user", "Weather in Paris?")]})
    assert ASKED == ["Paris"]  # the tool ran
    assert state["structured_response"] == Forecast(city="Paris", sky="cloudy")
    assert len(fake.calls) == 2  # one request to call, one to answer
    for call in fake.calls:  # each one carries the tools AND the schema
        assert [t["function"]["name"] for t in call.tools or []] == ["get_weather"]
        assert call.tool_choice == "auto"
        assert isinstance(call.params.constraint, JsonSchema)
        assert call.params.constraint.schema_dict["properties"].keys() == {"city", "sky"}
    assert isinstance(state["messages"][2], ToolMessage)


def test_tool_strategy_calls_the_tool_then_the_structured_tool() -> None:
    ASKED.clear()
    with scripted("agent-tools", _tool_strategy_turns) as fake:
        agent = create_agent(model=ChatMLXBatch(model="agent-tools"), tools=[get_weather],
                             response_format=ToolStrategy(Forecast))
        state = agent.invoke({"messages": [("user", "Weather in Paris?")]})
    assert ASKED == ["Paris"]
    assert state["structured_response"] == Forecast(city="Paris", sky="cloudy")
    assert len(fake.calls) == 2
    assert all(c.tool_choice == "required" and c.params.constraint is None for c in fake.calls)


def test_with_structured_output_takes_tools_and_returns_none_for_a_call() -> None:
    answer = Reply(pieces=(json.dumps({"city": "Oslo", "sky": "clear"}),))
    with scripted("so-tools", lambda c: answer if _called(c) else CALL) as fake:
        model = ChatMLXBatch(model="so-tools").with_structured_output(
            Forecast, tools=[get_weather], include_raw=True)
        first = model.invoke("Weather in Oslo?")
        assert first["parsed"] is None and first["parsing_error"] is None
        raw: AIMessage = first["raw"]
        assert [c["name"] for c in raw.tool_calls] == ["get_weather"]
        second = model.invoke([("user", "Weather in Oslo?"), raw,
                               ToolMessage("clear", tool_call_id="call_1")])
    assert second["parsed"] == Forecast(city="Oslo", sky="clear")
    assert all(isinstance(c.params.constraint, JsonSchema) and c.tools for c in fake.calls)


def test_function_calling_refuses_extra_tools() -> None:
    with pytest.raises(ValueError, match="json_schema"):
        ChatMLXBatch().with_structured_output(Forecast, method="function_calling",
                                              tools=[get_weather])
