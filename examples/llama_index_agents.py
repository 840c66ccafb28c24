"""Several LlamaIndex agents with tools, running concurrently on one shared MLX batch.

Each FunctionAgent is an independent workflow with its own tools. Their LLM calls all
go to MLXBatchLLM, whose instances share one engine per model, so the agents' turns
decode as rows of the same running batch without any batching code here. Each agent's
first turn is forced to call its tool (``initial_tool_choice``, enforced by a grammar),
which keeps even a 135M model on track; the next turn answers from the tool's result.

    python examples/llama_index_agents.py [--model PATH_OR_GGUF] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool

from mlx_providers import MLXBatchLLM

WEATHER = {"paris": "sunny, 21 C", "oslo": "snowing, -3 C", "lima": "cloudy, 18 C"}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER.get(city.strip().lower(), f"no weather report for {city}")


# (question, the agent's tools, the tool its first turn must call)
TASKS = [
    ("What is 17 plus 25?", [add, multiply], "add"),
    ("What is 6 times 7?", [add, multiply], "multiply"),
    ("What is the weather in Paris?", [get_weather], "get_weather"),
    ("What is the weather in Oslo?", [get_weather], "get_weather"),
    ("What is 120 plus 3?", [add], "add"),
    ("What is 12 times 12?", [multiply], "multiply"),
]


async def run_agent(llm: MLXBatchLLM, index: int, question: str, tools: list[object],
                    first_tool: str) -> tuple[str, list[str], str]:
    """Run one agent; return its question, the tool calls it made, and its answer."""
    agent = FunctionAgent(
        name=f"agent{index}", description="Answers with the help of its tools.", llm=llm,
        tools=[FunctionTool.from_defaults(fn) for fn in tools], initial_tool_choice=first_tool,
        # One call a turn: with parallel calls allowed a small model may write the call
        # twice, and max_tokens would cut the second (an OutputTruncatedError).
        allow_parallel_tool_calls=False,
        system_prompt="Answer the user's question using the tool results. Be brief.",
        streaming=False)
    handler = agent.run(user_msg=question, max_iterations=4, early_stopping_method="generate")
    calls: list[str] = []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            calls.append(f"{event.tool_name}({event.tool_kwargs}) -> {event.tool_output.content}")
    output: AgentOutput = await handler
    return question, calls, (output.response.content or "").strip()


async def main() -> None:
    """Run every task's agent at once, then print answers and the engine's batch stats."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model dir, .gguf, or hub id")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    llm = MLXBatchLLM(args.model, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    print(f"model: {llm.metadata.model_name} (loaded in {time.perf_counter() - t0:.1f} s, "
          f"context {llm.metadata.context_window} tokens)\n")

    t0 = time.perf_counter()
    results = await asyncio.gather(*(run_agent(llm, i, *task) for i, task in enumerate(TASKS)))
    elapsed = time.perf_counter() - t0
    for question, calls, answer in results:
        print(f"> {question}")
        for call in calls:
            print(f"  tool: {call}")
        print(f"  answer: {answer}\n")

    stats = llm.engine.stats()
    print(f"{len(TASKS)} agents in {elapsed:.1f} s: {stats.completed} LLM calls, "
          f"{stats.generated_tokens} tokens ({stats.generated_tokens / elapsed:.1f} tok/s "
          f"aggregate), peak batch {stats.peak_running} rows")
    print(f"stats: {stats}")


if __name__ == "__main__":
    asyncio.run(main())
