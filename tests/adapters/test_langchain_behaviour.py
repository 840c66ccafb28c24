"""ChatMLXBatch on a real (tiny) model: paths, streaming, tools, structured output,
transparent batching and cancellation, checked through the engine's own statistics."""

from __future__ import annotations

import asyncio
import json
import operator
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import Runnable, RunnableParallel
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from engine import LarkGrammar, OutputTruncatedError, RequestTimeoutError
from mlx_providers import ChatMLXBatch
from mlx_providers._langchain_inbound import chat_messages
from tests.conftest import wait_until

# Prompts whose greedy continuations on the tiny model do not stop before 48 tokens.
PROMPTS = ["Hello", "Hey", "hi", "Tell me a joke about cats.", "What is 2 + 2?",
           "Name a colour.", "Write a haiku.", "Say something."]
# Prompts that do not stop before 1500 tokens: rows that are still running when cancelled.
LONG = ["Hello", "Tell me a joke about cats.", "Name a colour.", "Write a haiku."]
CITY = {"type": "string", "maxLength": 8}  # bounded, so a random model's string ends


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=9)


class ForecastDict(TypedDict):
    """A weather forecast."""

    sky: Literal["clear", "cloudy"]


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return "sunny"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]}}}


@pytest.fixture
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """A private copy of the tiny model: its own engine, so its statistics start at zero."""
    target = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, target)
    yield str(target)
    ChatMLXBatch(model=str(target)).engine.close()


def chat(model_dir: str, **kw: Any) -> ChatMLXBatch:
    """A chat model on ``model_dir`` (48 greedy tokens unless told otherwise)."""
    return ChatMLXBatch(**{"model": model_dir, "max_tokens": 48, **kw})


_ALONE: dict[tuple[str, int], str] = {}


def alone(model_dir: str, prompts: list[str], max_tokens: int = 48) -> list[str]:
    """Each prompt's greedy answer with nothing else in the engine.

    Every ``model_dir`` is a byte-identical copy of the tiny model, so an answer is the same
    whichever copy ran it: each (prompt, max_tokens) runs alone once per session.
    """
    for prompt in prompts:
        if (prompt, max_tokens) not in _ALONE:
            answer = chat(model_dir, max_tokens=max_tokens).invoke(prompt).content
            _ALONE[prompt, max_tokens] = str(answer)
    return [_ALONE[prompt, max_tokens] for prompt in prompts]


# ----- the four paths ---------------------------------------------------------------------


async def test_all_four_paths_give_the_same_greedy_answer(model_dir: str) -> None:
    model = chat(model_dir)
    invoked = model.invoke("Hello")
    ainvoked = await model.ainvoke("Hello")
    streamed = list(model.stream("Hello"))
    astreamed = [c async for c in model.astream("Hello")]
    assert invoked.content and invoked.content == ainvoked.content
    for chunks in (streamed, astreamed):
        assert "".join(str(c.content) for c in chunks) == invoked.content
        assert len(chunks) > 2  # really streamed, not one chunk at the end
    for message in (invoked, ainvoked):
        usage = message.usage_metadata
        assert usage is not None
        assert (usage["input_tokens"], usage["output_tokens"]) == (34, 48)
    assert invoked.response_metadata["finish_reason"] == "length"


# Usage and metadata on the chunks, the streaming flag, errors, settings and early exits
# on a scripted engine: tests/adapters/test_scripted_engine.py.


def test_stop_strings_end_the_answer_before_the_stop(model_dir: str) -> None:
    full = str(chat(model_dir).invoke("Hello").content)
    stop = full[10:14]
    assert stop.strip() and stop not in full[:10]
    cut = chat(model_dir).invoke("Hello", stop=[stop])
    assert cut.content == full[:full.index(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"


# ----- messages ---------------------------------------------------------------------------


AGENT_HISTORY: list[BaseMessage] = [
    SystemMessage("You are terse."),
    HumanMessage("Weather in Paris?", name="alice"),
    HumanMessage("And be quick."),
    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
    ToolMessage([{"type": "text", "text": "sunny"}], tool_call_id="c1", name="get_weather"),
    AIMessage([{"type": "text", "text": "Checking Rome too."},
               {"type": "tool_use", "id": "c2", "name": "get_weather", "input": {}}],
              tool_calls=[{"name": "get_weather", "args": {"city": "Rome"}, "id": "c2"}]),
    ToolMessage("Error: service down", tool_call_id="c2", status="error"),
    SystemMessage("Answer in one word."),
    AIMessage("Sunny."),
    AIMessage("Mostly."),
    HumanMessage("Thanks"),
]


def test_an_agent_history_renders_through_the_chat_template(model_dir: str) -> None:
    model = chat(model_dir, max_tokens=4).bind_tools([get_weather])
    message = model.invoke(AGENT_HISTORY)
    assert isinstance(message, AIMessage)
    counted = chat(model_dir).get_num_tokens_from_messages(AGENT_HISTORY, tools=[get_weather])
    assert message.usage_metadata is not None
    assert message.usage_metadata["input_tokens"] == counted


def test_token_counts_use_the_model_tokenizer(model_dir: str) -> None:
    model = chat(model_dir)
    ids = model.get_token_ids("def main(): pass")
    assert ids == list(model.engine.tokenizer.encode("def main(): pass",
                                                     add_special_tokens=False))
    assert model.get_num_tokens("def main(): pass") == len(ids)
    answer = model.invoke([HumanMessage("Hello")])
    assert answer.usage_metadata is not None
    assert model.get_num_tokens_from_messages([HumanMessage("Hello")]) == \
        answer.usage_metadata["input_tokens"]


def test_profile_is_complete_from_construction(model_dir: str,
                                              thinking_model_dir: Path) -> None:
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.language_models import ModelProfile

    model = chat(model_dir, max_tokens=2)
    assert model.profile is not None
    assert model.profile["max_input_tokens"] == 2048  # config.json, nothing loaded
    assert model.profile["reasoning_output"] is False
    assert model.profile["tool_choice"] and model.profile["structured_output"]
    assert set(model.profile) <= set(ModelProfile.__annotations__)  # no unknown keys
    assert model.engine.stats().loaded is False
    # Middleware that reads the profile builds on a fresh instance.
    SummarizationMiddleware(model=model, trigger=("fraction", 0.5))
    model.invoke("Hello")
    assert model.profile["max_input_tokens"] == 2048  # the loaded engine agrees
    thinking = ChatMLXBatch(model=str(thinking_model_dir))
    assert thinking.profile is not None and thinking.profile["reasoning_output"] is True


def test_same_model_shares_one_engine_and_model_override_uses_another(
        model_dir: str, thinking_model_dir: Path) -> None:
    assert chat(model_dir).engine is chat(model_dir, temperature=0.7).engine
    message = chat(model_dir, max_tokens=4).invoke("Hello", model=str(thinking_model_dir))
    assert message.response_metadata["model_name"] == str(thinking_model_dir)


# ----- reasoning --------------------------------------------------------------------------


def test_reasoning_goes_to_reasoning_content(thinking_model_dir: Path) -> None:
    model = ChatMLXBatch(model=str(thinking_model_dir), max_tokens=30)
    grammar = LarkGrammar('start: <think> "let me see" </think> "It is sunny."')
    message = model.invoke("Weather?", constraint=grammar)
    assert message.content == "It is sunny."
    assert message.additional_kwargs["reasoning_content"] == "let me see"
    assert [b["type"] for b in message.content_blocks] == ["reasoning", "text"]
    full: Any = None
    for chunk in model.stream("Weather?", constraint=grammar):
        full = chunk if full is None else full + chunk
    assert full.content == "It is sunny."
    assert full.additional_kwargs["reasoning_content"] == "let me see"
    # LangChain's conventions: the raw and the normalised finish reason, v1 content blocks.
    for done in (message, full):
        assert done.response_metadata["finish_reason"] == "stop"
        assert done.response_metadata["normalized_finish_reason"] == "stop"
    v1 = ChatMLXBatch(model=str(thinking_model_dir), max_tokens=30, output_version="v1")
    v1_message = v1.invoke("Weather?", constraint=grammar)
    blocks = v1_message.content
    assert [(b["type"], b.get("reasoning") or b.get("text")) for b in blocks] == [  # type: ignore[union-attr]
        ("reasoning", "let me see"), ("text", "It is sunny.")]
    v1_full: Any = None
    for chunk in v1.stream("Weather?", constraint=grammar):
        v1_full = chunk if v1_full is None else v1_full + chunk
    # Kept in a history, each reply replays its reasoning for the template (a v1 reply from
    # its reasoning blocks alone too), and only the answer as content.
    only_blocks = v1_full.model_copy(update={"additional_kwargs": {}})
    for reply in (message, full, v1_message, v1_full, only_blocks):
        turn = chat_messages([HumanMessage("Weather?"), reply])[1]
        assert (turn.extra, turn.content) == ({"reasoning_content": "let me see"}, "It is sunny.")


# ----- tools ------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["any", "get_weather", True])
def test_forced_tool_choice_gives_valid_calls(model_dir: str, tool_choice: Any) -> None:
    model = chat(model_dir, max_tokens=60).bind_tools([WEATHER_TOOL], tool_choice=tool_choice,
                                                      parallel_tool_calls=False)
    message = model.invoke("Weather in Paris?")
    assert message.response_metadata["normalized_finish_reason"] == "tool_call"
    assert len(message.tool_calls) == 1 and not message.invalid_tool_calls
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    full: Any = None
    for chunk in model.stream("Weather in Paris?"):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk)
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(call["name"], call["args"])]
    assert full.tool_call_chunks and full.tool_call_chunks[0]["name"] == "get_weather"


def test_tool_choice_none_answers_in_text(model_dir: str) -> None:
    model = chat(model_dir).bind_tools([WEATHER_TOOL], tool_choice="none")
    message = model.invoke("Hello")
    assert message.content == chat(model_dir).invoke("Hello").content
    assert message.tool_calls == []


def test_malformed_calls_become_invalid_tool_calls(model_dir: str) -> None:
    broken = LarkGrammar('start: "Sure. " <tool_call> "\\n{\\"name\\": oops\\n" </tool_call>')
    model = chat(model_dir, max_tokens=40).bind_tools([WEATHER_TOOL])
    message = model.invoke("Weather?", constraint=broken)
    assert message.content == "Sure. " and message.tool_calls == []
    assert len(message.invalid_tool_calls) == 1
    assert "oops" in str(message.invalid_tool_calls[0]["args"])
    assert message.invalid_tool_calls[0]["error"]
    full: Any = None
    for chunk in model.stream("Weather?", constraint=broken):
        full = chunk if full is None else full + chunk
    assert full.tool_calls == [] and len(full.invalid_tool_calls) == 1


# ----- structured output ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_into_pydantic(model_dir: str, method: str) -> None:
    structured = chat(model_dir, max_tokens=80).with_structured_output(Forecast, method=method)  # type: ignore[arg-type]
    result = structured.invoke("Forecast for Oslo?")
    assert isinstance(result, Forecast)
    streamed = list(structured.stream("Forecast for Oslo?"))
    assert streamed and all(isinstance(r, Forecast) for r in streamed)
    assert streamed[-1] == result


@pytest.mark.parametrize("schema", [ForecastDict, {
    "title": "Sky", "type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}},
    "required": ["sky"]}], ids=["typeddict", "json_schema"])
async def test_structured_output_into_dicts(model_dir: str, schema: Any) -> None:
    structured = chat(model_dir, max_tokens=80).with_structured_output(schema)
    result = await structured.ainvoke("Sky over Oslo?")
    assert isinstance(result, dict) and set(result) == {"sky"}


def test_json_mode_gives_a_json_object(model_dir: str) -> None:
    structured = chat(model_dir, max_tokens=200).with_structured_output(
        None, method="json_mode", include_raw=True)
    result = structured.invoke("Return an object.")
    assert result["raw"].content.startswith("{")  # type: ignore[index]
    assert isinstance(result["parsed"], dict)  # type: ignore[index]


def test_include_raw_reports_parsing_errors_instead_of_raising(model_dir: str) -> None:
    structured = chat(model_dir, max_tokens=3).with_structured_output(Forecast, include_raw=True)
    result = structured.invoke("Forecast?")
    assert isinstance(result["raw"], AIMessage)  # type: ignore[index]
    assert result["parsed"] is None and result["parsing_error"] is not None  # type: ignore[index]
    ok = chat(model_dir, max_tokens=80).with_structured_output(Forecast, include_raw=True)
    good = ok.invoke("Forecast?")
    assert isinstance(good["parsed"], Forecast) and good["parsing_error"] is None  # type: ignore[index]


# ----- transparent batching ---------------------------------------------------------------


async def test_concurrent_ainvokes_on_separate_instances_share_one_batch(model_dir: str) -> None:
    prompts = (PROMPTS * 2)[:16]
    expected = alone(model_dir, prompts)
    results = await asyncio.gather(*(chat(model_dir).ainvoke(p) for p in prompts))
    assert [r.content for r in results] == expected  # greedy: batched == alone
    assert chat(model_dir).engine.stats().peak_running >= 8


def test_batch_runs_every_input_at_once_on_threads(model_dir: str) -> None:
    prompts = (PROMPTS * 2)[:16]
    expected = alone(model_dir, prompts)
    results = chat(model_dir).batch(prompts)
    assert [r.content for r in results] == expected
    assert chat(model_dir).engine.stats().peak_running >= 8


async def test_runnable_parallel_branches_share_one_batch(model_dir: str) -> None:
    branches = {f"b{i}": chat(model_dir) for i in range(16)}
    out = await RunnableParallel(branches).ainvoke("Tell me a joke about cats.")  # type: ignore[arg-type]
    assert len({m.content for m in out.values()}) == 1  # same prompt, greedy
    assert chat(model_dir).engine.stats().peak_running >= 8


def test_sync_runnable_parallel_with_enough_workers_batches(model_dir: str) -> None:
    branches = {f"b{i}": chat(model_dir) for i in range(12)}
    RunnableParallel(branches).invoke("Hello", config={"max_concurrency": 12})  # type: ignore[arg-type]
    assert chat(model_dir).engine.stats().peak_running >= 8


# ----- cancellation ------------------------------------------------------------------------


def running(model_dir: str) -> int:
    """Rows the engine holds right now."""
    return chat(model_dir).engine.stats().running


def cancelled(model_dir: str) -> int:
    """Requests the engine ended as cancelled (by a consumer or a timeout)."""
    return chat(model_dir).engine.stats().cancelled


async def first_chunks(model_dir: str, n: int, got: asyncio.Event) -> None:
    """Stream a long answer, signal after ``n`` chunks, then keep consuming."""
    count = 0
    async for _ in chat(model_dir, max_tokens=1500).astream("Tell me a joke about cats."):
        count += 1
        if count == n:
            got.set()


async def test_cancelling_an_astream_task_evicts_its_row_only(model_dir: str) -> None:
    siblings = PROMPTS[:3]
    expected = alone(model_dir, siblings)
    got = asyncio.Event()
    victim = asyncio.create_task(first_chunks(model_dir, 3, got))
    others = [asyncio.create_task(chat(model_dir).ainvoke(p)) for p in siblings]
    await got.wait()
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 4)
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    await asyncio.to_thread(wait_until, lambda: running(model_dir) <= 3)
    results = await asyncio.gather(*others)
    assert [r.content for r in results] == expected
    assert cancelled(model_dir) == 1


async def test_cancelling_an_ainvoke_task_evicts_its_row(model_dir: str) -> None:
    task = asyncio.create_task(chat(model_dir, max_tokens=1500).ainvoke("Hello"))
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 1


async def test_a_failing_sibling_branch_cancels_the_others(model_dir: str) -> None:
    async def fail_soon() -> None:
        await asyncio.to_thread(wait_until, lambda: running(model_dir) == 3)
        raise RuntimeError("branch failed")

    branches = [asyncio.create_task(chat(model_dir, max_tokens=1500).ainvoke(p))
                for p in LONG[:3]]
    failing = asyncio.create_task(fail_soon())
    await asyncio.wait([*branches, failing], return_when=asyncio.FIRST_EXCEPTION)
    # What LangGraph and asyncio.TaskGroup do when one branch raises: cancel the others.
    for branch in branches:
        branch.cancel()
    outcomes = await asyncio.gather(*branches, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert isinstance(failing.exception(), RuntimeError)
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 3


async def test_closing_an_astream_evicts_its_row(model_dir: str) -> None:
    stream = chat(model_dir, max_tokens=1500).astream("Hello")
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 1


async def test_breaking_out_of_astream_evicts_its_row(model_dir: str) -> None:
    async for _ in chat(model_dir, max_tokens=1500).astream("Hello"):
        break  # the abandoned generator is closed by the event loop, which cancels
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 1


def test_breaking_out_of_stream_evicts_its_row_only(model_dir: str) -> None:
    siblings = PROMPTS[3:6]
    expected = alone(model_dir, siblings)
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.extend(chat(model_dir).batch(siblings)))
    for i, _ in enumerate(chat(model_dir, max_tokens=1500).stream("Hello")):
        if i == 0:
            worker.start()
            wait_until(lambda: running(model_dir) == 4)
        if i == 2:
            break
    wait_until(lambda: running(model_dir) <= 3)
    worker.join(timeout=120)
    assert [r.content for r in results] == expected
    assert cancelled(model_dir) == 1


def test_closing_a_stream_generator_evicts_its_row(model_dir: str) -> None:
    stream = chat(model_dir, max_tokens=1500).stream("Hello")
    next(stream)
    stream.close()
    wait_until(lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 1


@pytest.mark.parametrize("how", ["invoke", "stream", "ainvoke", "astream"])
async def test_a_timeout_evicts_the_row_and_raises(model_dir: str, how: str) -> None:
    siblings = PROMPTS[:2]
    expected = alone(model_dir, siblings)
    others = [asyncio.create_task(chat(model_dir).ainvoke(p)) for p in siblings]
    slow = chat(model_dir, max_tokens=1500, timeout=0.2)
    with pytest.raises(RequestTimeoutError):
        if how == "invoke":
            await asyncio.to_thread(slow.invoke, "Hello")
        elif how == "stream":
            await asyncio.to_thread(lambda: list(slow.stream("Hello")))
        elif how == "ainvoke":
            await slow.ainvoke("Hello")
        else:
            _ = [chunk async for chunk in slow.astream("Hello")]
    assert [r.content for r in await asyncio.gather(*others)] == expected
    wait_until(lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 1



# ----- LangGraph ----------------------------------------------------------------------------


def langgraph_graph() -> Any:
    """``langgraph.graph``, or a skip naming the missing dev dependency."""
    return pytest.importorskip("langgraph.graph",
                               reason="langgraph is not installed (a dev dependency)")


class FanOut(TypedDict):
    prompts: list[str]
    answers: Annotated[list[str], operator.add]


async def test_langgraph_send_fan_out_shares_one_batch(model_dir: str) -> None:
    graph = langgraph_graph()
    from langgraph.types import Send

    model = chat(model_dir)

    async def answer(state: dict[str, str]) -> dict[str, list[str]]:
        return {"answers": [str((await model.ainvoke(state["prompt"])).content)]}

    builder = graph.StateGraph(FanOut)
    builder.add_node("answer", answer)
    builder.add_conditional_edges(
        graph.START, lambda s: [Send("answer", {"prompt": p}) for p in s["prompts"]], ["answer"])
    builder.add_edge("answer", graph.END)
    prompts = (PROMPTS * 2)[:16]
    expected = alone(model_dir, prompts)
    out = await builder.compile().ainvoke({"prompts": prompts, "answers": []})
    assert sorted(out["answers"]) == sorted(expected)
    assert model.engine.stats().peak_running >= 8


async def test_langgraph_sibling_failure_evicts_the_other_branches(model_dir: str) -> None:
    graph = langgraph_graph()
    model = chat(model_dir, max_tokens=1500)

    def branch(prompt: str) -> Any:
        async def node(_: FanOut) -> dict[str, list[str]]:
            return {"answers": [str((await model.ainvoke(prompt)).content)]}
        return node

    async def boom(_: FanOut) -> dict[str, list[str]]:
        await asyncio.to_thread(wait_until, lambda: running(model_dir) == 3)
        raise RuntimeError("branch failed")

    builder = graph.StateGraph(FanOut)
    for i, prompt in enumerate(LONG[:3]):
        builder.add_node(f"ask{i}", branch(prompt))
        builder.add_edge(graph.START, f"ask{i}")
    builder.add_node("boom", boom)
    builder.add_edge(graph.START, "boom")
    with pytest.raises(RuntimeError, match="branch failed"):
        await builder.compile().ainvoke({"prompts": [], "answers": []})
    await asyncio.to_thread(wait_until, lambda: running(model_dir) == 0)
    assert cancelled(model_dir) == 3


# ----- tool_calls as the finish reason, repeated calls, whitespace between calls -----------------


def weather_call(city: str) -> str:
    """One get_weather call as a Lark sequence (the markers are special tokens)."""
    body = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call> {json.dumps(chr(10) + body + chr(10))} </tool_call>"


# Newlines before, between and after the calls, as models write them.
TWO_CITIES = LarkGrammar(
    f'start: "\\n" {weather_call("Oslo")} "\\n" {weather_call("Rome")} "\\n"\n')
SAME_CALL_THRICE = LarkGrammar(
    f'start: {weather_call("Oslo")} "\\n" {weather_call("Oslo")} "\\n" {weather_call("Oslo")}\n')


def streamed(model: Runnable[Any, Any], prompt: str, **kw: Any) -> tuple[Any, list[Any]]:
    chunks = list(model.stream(prompt, **kw))
    full: Any = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full, chunks


def test_answers_with_calls_finish_as_tool_calls_with_no_content(model_dir: str) -> None:
    model = chat(model_dir, max_tokens=200).bind_tools([WEATHER_TOOL])
    message = model.invoke("Weather?", constraint=TWO_CITIES)
    assert [c["args"] for c in message.tool_calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert message.content == ""
    assert message.response_metadata["finish_reason"] == "tool_calls"
    full, chunks = streamed(model, "Weather?", constraint=TWO_CITIES)
    assert [c["args"] for c in full.tool_calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert full.content == "" and all(c.content == "" for c in chunks)
    assert full.response_metadata["finish_reason"] == "tool_calls"
    forced = chat(model_dir, max_tokens=60).bind_tools(
        [WEATHER_TOOL], tool_choice="any", parallel_tool_calls=False)
    one = forced.invoke("Weather in Paris?")
    assert len(one.tool_calls) == 1 and one.content == ""
    assert one.response_metadata["finish_reason"] == "tool_calls"
    plain = chat(model_dir, max_tokens=20).invoke("Hi", constraint=LarkGrammar('start: "Hi!"'))
    assert plain.response_metadata["finish_reason"] == "stop"


def test_a_repeated_call_ends_the_answer_and_is_dropped(model_dir: str) -> None:
    model = chat(model_dir, max_tokens=300).bind_tools([WEATHER_TOOL])
    message = model.invoke("Weather?", constraint=SAME_CALL_THRICE)
    assert [c["args"] for c in message.tool_calls] == [{"city": "Oslo"}]
    assert message.invalid_tool_calls == [] and message.content == ""
    assert message.response_metadata["finish_reason"] == "tool_calls"
    usage = message.usage_metadata
    assert usage is not None and usage["output_tokens"] < 300  # it ended at the repeat
    full, _ = streamed(model, "Weather?", constraint=SAME_CALL_THRICE)
    assert [c["args"] for c in full.tool_calls] == [{"city": "Oslo"}]


def calls_of(message: Any) -> tuple[list[Any], list[Any]]:
    """(name, args) of the kept calls and (name) of the invalid ones: what must agree
    between a stream and an invoke (ids differ: they are two requests)."""
    return ([(c["name"], c["args"]) for c in message.tool_calls],
            [c["name"] for c in message.invalid_tool_calls])


@pytest.mark.parametrize("case", ["one", "parallel", "repeat", "cut", "cut_sent"])
async def test_streamed_tool_calls_add_up_to_the_invoked_message(model_dir: str,
                                                                 case: str) -> None:
    """Calls stream as they are written: the name first, then argument fragments. A
    dropped (repeated) call never streams, so the summed stream is ``invoke``'s calls. A
    call cut while it could still be a repeat ("cut": its arguments so far a prefix of the
    first call's) was held, so it never streams either. A call cut after it diverged
    ("cut_sent") was sent as far as it was written (OpenAI semantics, as with ChatOpenAI):
    ``invoke`` lists it invalid, the summed stream may show LangChain's partial-JSON reading
    of it, so there only the kept calls must agree, and the cut call's fragments are what
    was generated of its arguments."""
    one_call = f'{weather_call("Oslo")}\n'
    before_cut = len(chat(model_dir).get_token_ids(
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci'))
    after_divergence = len(chat(model_dir).get_token_ids(
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'))
    model, kw = {
        "one": (chat(model_dir, max_tokens=60).bind_tools([WEATHER_TOOL]),
                {"constraint": LarkGrammar(f"start: {one_call}")}),
        "parallel": (chat(model_dir, max_tokens=200).bind_tools([WEATHER_TOOL]),
                     {"constraint": TWO_CITIES}),
        "repeat": (chat(model_dir, max_tokens=300).bind_tools([WEATHER_TOOL]),
                   {"constraint": SAME_CALL_THRICE}),
        "cut": (chat(model_dir, max_tokens=before_cut).bind_tools([WEATHER_TOOL]),
                {"constraint": TWO_CITIES}),  # max_tokens falls inside the second call's args
        "cut_sent": (chat(model_dir, max_tokens=after_divergence).bind_tools([WEATHER_TOOL]),
                     {"constraint": TWO_CITIES}),  # ... after "Ro", where it is no repeat
    }[case]
    invoked = await model.ainvoke("Weather?", **kw)
    chunks = [chunk async for chunk in model.astream("Weather?", **kw)]
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    if case != "cut_sent":
        assert calls_of(full) == calls_of(invoked)
    expected = {"one": ([("get_weather", {"city": "Oslo"})], []),
                "parallel": ([("get_weather", {"city": "Oslo"}),
                              ("get_weather", {"city": "Rome"})], []),
                "repeat": ([("get_weather", {"city": "Oslo"})], []),
                "cut": ([("get_weather", {"city": "Oslo"})], [None]),  # held: name unread
                # sent, so its name was read as it streamed
                "cut_sent": ([("get_weather", {"city": "Oslo"})], ["get_weather"])}[case]
    assert calls_of(invoked) == expected
    # Each call's first chunk has its id and name, its argument fragments follow.
    pieces: dict[int, list[Any]] = {}
    for chunk in chunks:
        for c in chunk.tool_call_chunks:
            pieces.setdefault(c["index"], []).append(c)
    kept = len(expected[0])
    streamed = range(kept + (case == "cut_sent"))  # a never-streamed invalid call comes last
    assert all(p[0]["id"] and p[0]["name"] and (len(p) > 2 or i >= kept)  # a cut call may
               and all(c["id"] is None and c["name"] is None for c in p[1:])  # be short
               for i, p in ((i, pieces[i]) for i in streamed))
    sent = {i: "".join(c["args"] for c in p) for i, p in pieces.items()}
    assert [(pieces[i][0]["name"], json.loads(sent[i])) for i in range(kept)] == expected[0]
    if case == "cut_sent":  # sent as far as written; the whole answer: invalid, length
        assert calls_of(full)[0][:kept] == expected[0] and set(sent) == {0, 1}
        assert sent[1] and invoked.invalid_tool_calls[0]["args"].endswith(sent[1])
        assert '{"city": "Rome"}'.startswith(sent[1])
        assert full.response_metadata["finish_reason"] == "length"
        assert invoked.response_metadata["finish_reason"] == "length"
    if case == "parallel":  # the first call is out before the row ends
        first = next(i for i, c in enumerate(chunks) if c.tool_call_chunks)
        assert first < len(chunks) - 1


# ----- outputs cut at max_tokens are said plainly ------------------------------------------


@pytest.mark.parametrize("tool_choice", ["any", "get_weather"])
async def test_a_forced_call_cut_at_max_tokens_raises_naming_the_limit(
        model_dir: str, tool_choice: str) -> None:
    model = chat(model_dir, max_tokens=3).bind_tools([WEATHER_TOOL], tool_choice=tool_choice)
    cut = r"forced tool call was cut at max_tokens=3 after 3 tokens"
    with pytest.raises(OutputTruncatedError, match=cut):
        model.invoke("Weather in Paris?")
    with pytest.raises(OutputTruncatedError, match=cut):
        await model.ainvoke("Weather in Paris?")
    with pytest.raises(OutputTruncatedError, match=cut):
        list(model.stream("Weather in Paris?"))
    kept = chat(model_dir, max_tokens=3).bind_tools(
        [WEATHER_TOOL], tool_choice=tool_choice, raise_on_truncated_call=False)
    message = kept.invoke("Weather in Paris?")
    assert message.tool_calls == [] and len(message.invalid_tool_calls) == 1
    assert message.response_metadata["finish_reason"] == "length"


def test_an_auto_call_cut_at_max_tokens_stays_an_invalid_call(model_dir: str) -> None:
    model = chat(model_dir, max_tokens=4).bind_tools([WEATHER_TOOL])
    message = model.invoke("Weather?", constraint=TWO_CITIES)
    assert message.tool_calls == [] and len(message.invalid_tool_calls) == 1
    assert message.response_metadata["finish_reason"] == "length"


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
async def test_structured_output_cut_at_max_tokens_raises_naming_the_limit(
        model_dir: str, method: str) -> None:
    schema = None if method == "json_mode" else Forecast
    model = chat(model_dir, max_tokens=3)
    structured = model.with_structured_output(schema, method=method)  # type: ignore[arg-type]
    cut = r"cut at max_tokens=3 after 3 tokens before it was complete; raise max_tokens"
    with pytest.raises(OutputTruncatedError, match=cut) as caught:
        structured.invoke("Forecast for Oslo?")
    assert isinstance(caught.value, OutputParserException)  # LangChain's parse-error type
    with pytest.raises(OutputTruncatedError, match=cut):
        await structured.ainvoke("Forecast for Oslo?")
    with pytest.raises(OutputTruncatedError, match=cut):
        list(structured.stream("Forecast for Oslo?"))
    raw = model.with_structured_output(schema, method=method, include_raw=True)  # type: ignore[arg-type]
    result = raw.invoke("Forecast for Oslo?")
    assert isinstance(result["raw"], AIMessage)  # type: ignore[index]
    assert result["raw"].response_metadata["finish_reason"] == "length"  # type: ignore[index]
    assert result["parsed"] is None  # type: ignore[index]
    assert isinstance(result["parsing_error"], OutputTruncatedError)  # type: ignore[index]
    assert "max_tokens=3" in str(result["parsing_error"])  # type: ignore[index]
