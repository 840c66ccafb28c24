"""LangChain ``create_agent`` with tools and a response format on the default model.

Before tools and a schema could share a request, ProviderStrategy's requests carried the
schema as the whole reply's grammar: SmolLM2 answered with schema JSON at once and never
called a tool. Now each request is one grammar for "a call or the answer", and the agent's
first turn calls the tool. What SmolLM2-135M itself then does is measured here: greedy,
it called ``get_weather(city="Paris")`` again on every later turn (4 calls in 4 turns under
both strategies). The repeat guard (``repeat_answered_calls=False``, the default) refuses
an answered call under ProviderStrategy ("auto" beside the schema): the model then writes
other arguments rather than answering ("Paris", "Paris},", "Paris}}, {", then a call cut
at max_tokens: 3 calls, no structured response). ToolStrategy forces a call
(``tool_choice="any"``), which the guard leaves alone: 4 calls of "Paris" as before. The
run never ends in a structured response on its own. With ``tool_call_limit=1`` (a tool
called and answered once is no longer offered where a grammar decides the reply) both
strategies call the tool on the first turn and answer in the schema on the second.
Run with ``make test-real``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import pytest
from langchain.agents import create_agent
from langchain.agents.structured_output import (
    ProviderStrategy,
    StructuredOutputValidationError,
    ToolStrategy,
)
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError
from pydantic import BaseModel, Field

from mlx_providers import ChatMLXBatch

pytestmark = pytest.mark.real

ASKED: list[str] = []
QUESTION = {"messages": [("user", "What is the weather like in Paris?")]}
SYSTEM = "You are a helpful assistant. Use get_weather for weather questions."


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city")
    summary: str = Field(description="the weather, in a few words")


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    ASKED.append(city)
    return f"It is sunny and 21 degrees in {city}."


STRATEGIES: dict[str, Any] = {"provider": ProviderStrategy(Weather),
                              "tool": ToolStrategy(Weather)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_agents_first_turn_calls_the_tool(strategy: str) -> None:
    model = ChatMLXBatch(max_tokens=120)
    agent = create_agent(model=model, tools=[get_weather], system_prompt=SYSTEM,
                         response_format=STRATEGIES[strategy])
    first = None
    for update in agent.stream(QUESTION, {"recursion_limit": 3}, stream_mode="updates"):
        if "model" in update:
            first = update["model"]["messages"][-1]
            break
    assert isinstance(first, AIMessage)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_agent_calls_the_tool_then_answers_in_the_schema(strategy: str) -> None:
    # Two model calls: get_weather("Paris"), then (the tool at its limit) the answer, as
    # JSON under ProviderStrategy or as the Weather tool's call under ToolStrategy.
    ASKED.clear()
    model = ChatMLXBatch(max_tokens=120, tool_call_limit=1)
    agent = create_agent(model=model, tools=[get_weather], system_prompt=SYSTEM,
                         response_format=STRATEGIES[strategy])
    before = model.engine.stats().completed
    state = agent.invoke(QUESTION, {"recursion_limit": 8})
    assert ASKED == ["Paris"]
    assert isinstance(state["structured_response"], Weather)
    assert state["structured_response"].city == "Paris"
    assert model.engine.stats().completed - before == 2


def test_under_provider_strategy_no_answered_call_is_made_again() -> None:
    # The guard on the real model: each call the agent makes differs from every call
    # before it (without the guard: "Paris" four times). How the run ends is the model's.
    ASKED.clear()
    agent = create_agent(model=ChatMLXBatch(max_tokens=120), tools=[get_weather],
                         system_prompt=SYSTEM, response_format=ProviderStrategy(Weather))
    with contextlib.suppress(GraphRecursionError, StructuredOutputValidationError):
        agent.invoke(QUESTION, {"recursion_limit": 8})  # the limit, or a cut last reply
    assert ASKED[:1] == ["Paris"] and len(ASKED) >= 2
    assert len(set(ASKED)) == len(ASKED), ASKED


def test_a_fresh_default_model_has_a_complete_profile() -> None:
    from langchain.agents.middleware import SummarizationMiddleware

    model = ChatMLXBatch()
    assert model.profile is not None
    assert model.profile["max_input_tokens"] == 8192  # the GGUF header's context length
    assert model.profile["reasoning_output"] is False
    SummarizationMiddleware(model=model, trigger=("fraction", 0.5))


def test_llm_tool_selector_middleware_selects_and_the_agent_runs() -> None:
    # Its selection schema is an array of tool-name choices: greedy SmolLM2 used to repeat
    # one name until max_tokens; bounded to one item per choice, the selection ends.
    from langchain.agents.middleware import LLMToolSelectorMiddleware

    @tool
    def translate(text: str) -> str:
        """Translate a text to French."""
        return text

    @tool
    def search(query: str) -> str:
        """Search the web."""
        return "nothing"

    model = ChatMLXBatch(max_tokens=120)
    selections: list[Any] = []

    class Recorder(LLMToolSelectorMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            def seen(req: Any) -> Any:
                selections.append([t.name for t in req.tools])
                return handler(req)
            return super().wrap_model_call(request, seen)

    agent = create_agent(model=model, tools=[get_weather, translate, search],
                         system_prompt=SYSTEM, middleware=[Recorder(max_tools=2)])
    agent.invoke(QUESTION, {"recursion_limit": 4})  # a selection that failed to parse raises
    assert selections and all(1 <= len(names) <= 2 for names in selections)


class Sky(BaseModel):
    """The sky over a city (bounded: a 135M model's free strings can run to max_tokens)."""

    city: str = Field(max_length=20)
    sky: Literal["sunny", "cloudy", "rainy"]


@pytest.mark.parametrize("with_tool", [False, True])
async def test_function_agent_structured_output_costs_no_extra_request(with_tool: bool) -> None:
    # LlamaIndex's FunctionAgent(output_cls=...) asks the LLM once more to format the
    # conversation; with MLXBatchLLM(output_cls=...) every turn is a call or the schema's
    # JSON, and that last request is answered from the agent's final message.
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    from mlx_providers import MLXBatchLLM

    def weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is sunny and 21 degrees in {city}."

    # Offered the tool with no limit, greedy SmolLM2-135M calls it on every turn (under
    # the repeat guard with other cities: 'Paris', 'Paris,', 'Paris, France,').
    llm = MLXBatchLLM(max_tokens=120, output_cls=Sky, tool_call_limit=1)
    tools = [FunctionTool.from_defaults(weather)] if with_tool else []
    agent = FunctionAgent(llm=llm, tools=tools, output_cls=Sky, system_prompt=SYSTEM)
    before = llm.engine.stats().completed
    output = await agent.run(user_msg="What is the weather like in Paris?", max_iterations=4)
    turns = llm.engine.stats().completed - before
    Sky.model_validate(output.structured_response)
    assert turns == 1 + len(output.tool_calls)  # one request per turn, none to re-format


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_same_agent_over_the_server_with_langchain_openai(strategy: str) -> None:
    # The real client: ChatOpenAI sends tools beside response_format (ProviderStrategy) or
    # a required choice (ToolStrategy) to the OpenAI-compatible server on loopback.
    from langchain_openai import ChatOpenAI

    from mlx_providers.server import create_app
    from tests.server.conftest import LiveServer

    engine = ChatMLXBatch().engine  # the process's default-model engine
    server = LiveServer(create_app({"smol": engine})).start()
    try:
        ASKED.clear()
        model = ChatOpenAI(model="smol", base_url=server.base_url, api_key="x",  # type: ignore[arg-type]
                           max_retries=0, timeout=120, temperature=0, max_tokens=120,
                           extra_body={"tool_call_limit": 1})
        agent = create_agent(model=model, tools=[get_weather], system_prompt=SYSTEM,
                             response_format=STRATEGIES[strategy])
        state = agent.invoke(QUESTION, {"recursion_limit": 8})
    finally:
        server.stop()
    assert ASKED == ["Paris"]
    assert isinstance(state["structured_response"], Weather)
