"""LlamaIndex ``FunctionAgent(output_cls=...)`` on MLXBatchLLM: with ``MLXBatchLLM(output_cls=
...)`` each agent turn carries the tools and the schema in one request (a call or the
answer, one grammar) and the agent's structured output costs no extra request. On a
scripted engine, so the requests can be counted and read."""

from __future__ import annotations

import json

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from engine import FinishReason, JsonSchema, ToolCall
from mlx_providers import MLXBatchLLM
from mlx_providers._llama_index_agents import transcript_answer
from tests.fake_engine import Reply, Submitted, scripted


class Forecast(BaseModel):
    """A weather forecast."""

    city: str
    sky: str


def get_weather(city: str) -> str:
    """Current weather for a city."""
    return "cloudy"


ANSWER = json.dumps({"city": "Paris", "sky": "cloudy"})


def _turns(call: Submitted) -> Reply:
    """A tool call first, then the schema's answer; a formatting request gets it too."""
    if any(m.role == "tool" for m in call.prompt.messages):  # type: ignore[union-attr]
        return Reply(pieces=(ANSWER,))
    if call.tools:
        return Reply(pieces=(), finish_reason=FinishReason.TOOL_CALLS,
                     tool_calls=(ToolCall("call_1", "get_weather", {"city": "Paris"}),))
    return Reply(pieces=(ANSWER,))  # generate_structured_response's second request


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("bound", [True, False], ids=["llm-output-cls", "agent-only"])
async def test_structured_function_agent_requests(streaming: bool, bound: bool) -> None:
    name = f"li-agent-{streaming}-{bound}"
    with scripted(name, _turns) as fake:
        llm = MLXBatchLLM(name, output_cls=Forecast if bound else None)
        agent = FunctionAgent(llm=llm, tools=[FunctionTool.from_defaults(get_weather)],
                              output_cls=Forecast, streaming=streaming)
        output = await agent.run(user_msg="Weather in Paris?")
    assert output.structured_response == {"city": "Paris", "sky": "cloudy"}
    assert [c.tool_name for c in output.tool_calls] == ["get_weather"]
    if bound:  # the tool turn and the answer: tools and schema in each, nothing after
        assert len(fake.calls) == 2
        assert all(c.tools and isinstance(c.params.constraint, JsonSchema) for c in fake.calls)
    else:  # LlamaIndex's own path: a third request re-formats the conversation
        assert len(fake.calls) == 3
        assert fake.calls[0].params.constraint is None


def _transcript(*sections: tuple[str, str]) -> list[ChatMessage]:
    body = "".join(f"\t<{role}>\n\t\t<message>{text}</message>\n\t</{role}>\n"
                   for role, text in sections)
    return [ChatMessage(role="user", content=f"<current_conversation>\n{body}"
                        "</current_conversation>\n\nGiven the conversation, format the "
                        "output according to the provided schema.")]


def test_only_a_final_assistant_answer_valid_for_the_schema_is_taken() -> None:
    assert transcript_answer(Forecast, _transcript(("user", "hi"), ("assistant", ANSWER))) == (
        Forecast(city="Paris", sky="cloudy"))
    # The user spoke last, the answer is not the schema's, or not an agent transcript.
    assert transcript_answer(Forecast, _transcript(("assistant", ANSWER), ("user", "and?"))) is None
    assert transcript_answer(Forecast, _transcript(("assistant", '{"city": "Paris"}'))) is None
    assert transcript_answer(Forecast, [ChatMessage(role="user", content=ANSWER)]) is None
