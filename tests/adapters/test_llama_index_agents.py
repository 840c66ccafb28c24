"""A LlamaIndex FunctionAgent on the tiny tool-capable model: two tools called in parallel,
their results fed back through the chat template, and a final answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool

from engine import LarkGrammar
from mlx_providers import MLXBatchLLM
from tests.conftest import own_copy


def _call(name: str, a: int, b: int) -> str:
    body = json.dumps({"name": name, "arguments": {"a": a, "b": b}})
    return f"<tool_call> {json.dumps(chr(10) + body + chr(10))} </tool_call>"


# The random-weight model cannot choose calls by itself, so the test forces its first turn
# to call both tools at once (as a capable model would) with an ordinary per-call grammar.
BOTH_TOOLS = LarkGrammar(f'start: {_call("add", 1, 2)} "\\n" {_call("multiply", 3, 4)}\n')


class ScriptedTurns(MLXBatchLLM):
    """MLXBatchLLM whose agent turns are grammar-forced: both calls, then an answer that
    quotes the tool results it was given (so the answer proves they reached the model)."""

    seen: list[list[ChatMessage]] = []

    def _prepare_chat_with_tools(
        self,
        tools: Any,
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        chat_kwargs = super()._prepare_chat_with_tools(
            tools, user_msg, chat_history, verbose, allow_parallel_tool_calls, tool_required,
            tool_choice, **kwargs)
        messages: list[ChatMessage] = chat_kwargs["messages"]
        self.seen.append(messages)
        results = [m.content for m in messages if m.role == MessageRole.TOOL]
        if not results:
            chat_kwargs["constraint"] = BOTH_TOOLS
        else:
            answer = f"1 + 2 = {results[0]} and 3 * 4 = {results[1]}."
            chat_kwargs["constraint"] = LarkGrammar(f"start: {json.dumps(answer)}\n")
        return chat_kwargs


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_copy(tiny_model_dir, tmp_path_factory.mktemp("li-agent") / "tiny")


@pytest.fixture
def llm(model_dir: Path) -> Iterator[ScriptedTurns]:
    model = ScriptedTurns(model_dir, max_tokens=96)
    model.seen = []
    yield model


@pytest.fixture(scope="module", autouse=True)
def close_engine(model_dir: Path) -> Iterator[None]:
    yield
    MLXBatchLLM(model_dir).engine.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "achat"])
async def test_function_agent_calls_two_tools_in_parallel_and_answers(
        llm: ScriptedTurns, streaming: bool) -> None:
    agent = FunctionAgent(name="calculator", description="Does arithmetic.", llm=llm,
                          tools=[FunctionTool.from_defaults(add),
                                 FunctionTool.from_defaults(multiply)],
                          system_prompt="Use the tools.", streaming=streaming)
    handler = agent.run(user_msg="What are 1 + 2 and 3 * 4?")
    events = [event async for event in handler.stream_events()]
    output = await handler
    results = [e for e in events if isinstance(e, ToolCallResult)]
    assert sorted((r.tool_name, r.tool_output.content) for r in results) == [
        ("add", "3"), ("multiply", "12")]
    assert len({r.tool_id for r in results}) == 2
    assert str(output.response.content) == "1 + 2 = 3 and 3 * 4 = 12."
    # Both calls came from one model turn, and the second turn saw both results by id.
    _first, second = llm.seen
    assert [m.role for m in second[-3:]] == [MessageRole.ASSISTANT, MessageRole.TOOL,
                                              MessageRole.TOOL]
    call_ids = {b.tool_call_id for b in second[-3].blocks if hasattr(b, "tool_call_id")}
    assert call_ids == {m.additional_kwargs["tool_call_id"] for m in second[-2:]}
    if streaming:
        deltas = "".join(e.delta for e in events if isinstance(e, AgentStream))
        assert deltas.endswith("1 + 2 = 3 and 3 * 4 = 12.")
