"""A LlamaIndex ``FunctionAgent`` on the default model with a forced first tool call.

``initial_tool_choice`` names the tool for the agent's first turn, as a user whose small
model will not decide by itself would set it. Each case asks one question one tool answers;
it passes when the agent called that tool with the arguments the question gives and its
final answer carries the tool's result. Run with ``make test-real``; what SmolLM2-135M
itself cannot do is marked ``xfail`` with what was measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool

from mlx_providers import MLXBatchLLM

pytestmark = pytest.mark.real


def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers a and b."""
    return a + b


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


def word_length(word: str) -> int:
    """Count the letters of a word."""
    return len(word)


@dataclass(frozen=True)
class Case:
    question: str
    tool: Any
    arguments: dict[str, Any]
    answer: str  # the tool's result, as the final answer must carry it


CASES = {
    "multiply": Case("What is 7 times 6?", multiply, {"a": 7, "b": 6}, "42"),
    "add": Case("What is 12 plus 30?", add, {"a": 12, "b": 30}, "42"),
    "weather": Case("What is the weather like in Paris?", get_weather, {"city": "Paris"},
                    "sunny"),
    "word_length": Case("How many letters are in the word 'banana'?", word_length,
                        {"word": "banana"}, "6"),
}

# Cases SmolLM2-135M cannot do, by case name: what it does instead (measured).
MODEL_XFAILS: dict[str, str] = {}


@pytest.fixture(scope="module")
def llm() -> Iterator[MLXBatchLLM]:
    model = MLXBatchLLM(max_tokens=128, temperature=0)
    yield model
    model.engine.close()


@pytest.mark.parametrize("name", list(CASES))
async def test_function_agent_forced_first_call_answers(llm: MLXBatchLLM, name: str,
                                                        request: pytest.FixtureRequest) -> None:
    if name in MODEL_XFAILS:
        request.node.add_marker(pytest.mark.xfail(reason=MODEL_XFAILS[name]))
    case = CASES[name]
    tools = [FunctionTool.from_defaults(fn) for fn in (multiply, add, get_weather, word_length)]
    agent = FunctionAgent(name="assistant", description="Answers with tools.", llm=llm,
                          tools=tools, initial_tool_choice=case.tool.__name__,
                          system_prompt="You are a helpful assistant. Use the tools.")
    handler = agent.run(user_msg=case.question)
    calls = [event async for event in handler.stream_events()
             if isinstance(event, ToolCallResult)]
    output = await handler
    assert calls, "the forced first turn made no call"
    assert (calls[0].tool_name, calls[0].tool_kwargs) == (case.tool.__name__, case.arguments)
    assert case.answer in str(output.response.content), output.response.content
