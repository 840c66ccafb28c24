"""MLXBatchLLM on the tiny model: chat/complete (sync, async, streaming), usage, events, tools,
structured output, reasoning, and a RAG query engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from llama_index.core import Document, SimpleKeywordTableIndex
from llama_index.core.base.llms.types import (
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
    LLMStructuredPredictEndEvent,
)
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from engine import (
    ChatRequest,
    LarkGrammar,
    OutputTruncatedError,
    SamplingParams,
    messages_from_openai,
)
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.messages import template_messages
from mlx_providers import MLXBatchLLM
from mlx_providers._llama_index_inbound import to_engine_messages
from testkit.families import FAMILIES, AssetUnavailable, built_family_model
from tests.conftest import _cache_root, own_copy, prompt_renderer, request_for
from tests.fake_engine import scripted

ASK = [ChatMessage(role=MessageRole.USER, content="What is the weather in Paris?")]
PLAIN_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def add_call(a: int, b: int) -> str:
    """One add call as a Lark sequence (the call markers are special tokens)."""
    body = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
    return f"<tool_call> {json.dumps(chr(10) + body + chr(10))} </tool_call>"


# Two different calls, with the newlines models write before, between and after them.
TWO_ADDS = LarkGrammar(f'start: "\\n" {add_call(1, 2)} "\\n" {add_call(3, 4)} "\\n"\n')
SAME_ADD_THRICE = LarkGrammar(
    f'start: {add_call(1, 2)} "\\n" {add_call(1, 2)} "\\n" {add_call(1, 2)}\n')


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_copy(tiny_model_dir, tmp_path_factory.mktemp("li-core") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[MLXBatchLLM]:
    model = MLXBatchLLM(model_dir, max_tokens=16, engine_config={"max_batch": 16})
    yield model
    model.engine.close()


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class TimeArgs(BaseModel):
    tz: Literal["UTC", "CET", "JST"]


def get_time(tz: str) -> str:
    """Current time in a time zone."""
    return f"12:00 {tz}"


def clock_tool() -> FunctionTool:
    # A closed argument schema (an enum): a forced call on a random model must end.
    return FunctionTool.from_defaults(get_time, fn_schema=TimeArgs)


def engine_reference(llm: MLXBatchLLM, prompt: Any, max_tokens: int = 16) -> Any:
    return llm.engine.submit(request_for(prompt, SamplingParams(max_tokens=max_tokens))).result()


# ----- construction and metadata ------------------------------------------------------


def test_metadata_comes_from_the_model(llm: MLXBatchLLM, model_dir: Path) -> None:
    meta = llm.metadata
    assert meta.context_window == llm.engine.stats().context_limit == 2048
    assert meta.num_output == 16
    assert meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == str(model_dir)


def test_instances_on_one_model_share_the_engine(llm: MLXBatchLLM, model_dir: Path) -> None:
    other = MLXBatchLLM(str(model_dir), temperature=0.7, seed=3)
    assert other.engine is llm.engine


def test_bad_settings_fail_at_construction_naming_the_field(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="temperature"):
        MLXBatchLLM(model_dir, temperature=-1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        MLXBatchLLM(model_dir, max_tokens=0)


def test_unknown_per_call_options_raise(llm: MLXBatchLLM) -> None:
    with pytest.raises(TypeError, match="bogus"):
        llm.chat(ASK, bogus=1)


# ----- chat and completion ------------------------------------------------------------


async def test_chat_and_complete_sync_and_async_match_the_engine(llm: MLXBatchLLM) -> None:
    chat_ref = engine_reference(llm, PLAIN_ASK)
    text_ref = engine_reference(llm, "Once upon a time")
    assert llm.chat(ASK).message.content == chat_ref.content
    assert (await llm.achat(ASK)).message.content == chat_ref.content
    assert llm.complete("Once upon a time").text == text_ref.content
    assert (await llm.acomplete("Once upon a time")).text == text_ref.content
    # Per-call overrides reach the engine.
    short = llm.chat(ASK, max_tokens=4)
    assert short.raw["usage"]["completion_tokens"] == 4
    assert short.raw["finish_reason"] == "length"


def test_sync_streams_carry_delta_and_accumulated_text(llm: MLXBatchLLM) -> None:
    reference = engine_reference(llm, PLAIN_ASK)
    chunks = list(llm.stream_chat(ASK))
    assert "".join(c.delta or "" for c in chunks) == reference.content
    so_far = ""
    for chunk in chunks[:-1]:
        so_far += chunk.delta or ""
        assert chunk.message.content == so_far
    assert chunks[-1].message.content == reference.content
    assert chunks[-1].raw["usage"]["completion_tokens"] == 16
    text_chunks = list(llm.stream_complete("Once upon a time"))
    assert text_chunks[-1].text == "".join(c.delta or "" for c in text_chunks)
    assert text_chunks[-1].text == engine_reference(llm, "Once upon a time").content


async def test_async_streams_carry_delta_and_accumulated_text(llm: MLXBatchLLM) -> None:
    reference = engine_reference(llm, PLAIN_ASK)
    chunks = [c async for c in await llm.astream_chat(ASK)]
    assert "".join(c.delta or "" for c in chunks) == reference.content
    assert [c.message.content for c in chunks][-1] == reference.content
    assert chunks[-1].raw["usage"]["prompt_tokens"] == reference.usage.prompt_tokens
    text_chunks = [c async for c in await llm.astream_complete("Once upon a time")]
    assert text_chunks[-1].text == "".join(c.delta or "" for c in text_chunks)
    assert len(text_chunks) > 2  # really streamed, not one final chunk


async def test_stream_requests_start_at_first_iteration() -> None:
    with scripted("li-lazy-streams") as fake:
        llm = MLXBatchLLM("li-lazy-streams", max_tokens=16)
        stream = await llm.astream_chat(ASK)
        text_stream = await llm.astream_complete("Once upon a time")
        sync_stream = llm.stream_chat(ASK)
        assert fake.calls == []
        first = await stream.__anext__()
        assert len(fake.calls) == 1 and first.delta
        await stream.aclose()
        next(sync_stream)
        assert len(fake.calls) == 2
        sync_stream.close()
        await text_stream.aclose()  # never iterated: nothing to submit or cancel
        assert len(fake.calls) == 2


def test_usage_feeds_llama_index_token_counting(llm: MLXBatchLLM, model_dir: Path) -> None:
    counter = TokenCountingHandler(tokenizer=lambda text: text.split())
    counted = MLXBatchLLM(model_dir, max_tokens=8, callback_manager=CallbackManager([counter]))
    response = counted.chat(ASK)
    usage = response.raw["usage"]
    assert counter.prompt_llm_token_count == usage["prompt_tokens"] > 20
    assert counter.completion_llm_token_count == usage["completion_tokens"] == 8
    list(counted.stream_chat(ASK, max_tokens=5))
    assert counter.completion_llm_token_count == 8 + 5
    text = counted.complete("Once upon a time")
    assert counter.prompt_llm_token_count == (usage["prompt_tokens"] * 2
                                              + text.raw["usage"]["prompt_tokens"])
    assert counter.completion_llm_token_count == 8 + 5 + 8


class Recorder(BaseEventHandler):
    """Collects instrumentation events."""

    events: list[BaseEvent] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    root = get_dispatcher()
    handler = Recorder()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


async def test_instrumentation_events_fire(llm: MLXBatchLLM, recorder: Recorder) -> None:
    await llm.achat(ASK)
    [c async for c in await llm.astream_chat(ASK)]
    llm.complete("Once upon a time")
    kinds = [type(e) for e in recorder.events]
    assert kinds.count(LLMChatStartEvent) == 2 and kinds.count(LLMChatEndEvent) == 2
    assert LLMChatInProgressEvent in kinds
    assert LLMCompletionStartEvent in kinds and LLMCompletionEndEvent in kinds
    ends = [e for e in recorder.events if isinstance(e, LLMChatEndEvent)]
    assert all(e.response is not None and e.response.raw["usage"] for e in ends)


# ----- tools --------------------------------------------------------------------------


def test_parallel_calls_to_one_tool_get_distinct_ids(llm: MLXBatchLLM) -> None:
    tools = [FunctionTool.from_defaults(add)]
    response = llm.chat_with_tools(tools, user_msg="Add 1 and 2, twice.", max_tokens=64,
                                   allow_parallel_tool_calls=True, constraint=TWO_ADDS)
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                             ("add", {"a": 3, "b": 4})]
    assert len({c.tool_id for c in calls}) == 2
    assert response.message.content == ""
    assert response.raw["finish_reason"] == "tool_calls"
    single = llm.chat_with_tools(tools, user_msg="Add 1 and 2.", max_tokens=64,
                                 allow_parallel_tool_calls=False, constraint=TWO_ADDS)
    assert len(llm.get_tool_calls_from_response(single)) == 1
    chunks = list(llm.stream_chat_with_tools(tools, user_msg="Add 1 and 2, twice.",
                                             max_tokens=64, allow_parallel_tool_calls=True,
                                             constraint=TWO_ADDS))
    streamed = llm.get_tool_calls_from_response(chunks[-1])
    assert [c.tool_kwargs for c in streamed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert len({c.tool_id for c in streamed} | {c.tool_id for c in calls}) == 4
    assert all(c.delta == "" for c in chunks) and chunks[-1].message.content == ""
    assert chunks[-1].raw["finish_reason"] == "tool_calls"


async def test_astream_chat_streams_each_call_as_it_is_written(llm: MLXBatchLLM) -> None:
    tools = [FunctionTool.from_defaults(add)]
    stream = await llm.astream_chat_with_tools(tools, user_msg="Add 1 and 2, twice.",
                                               max_tokens=64, allow_parallel_tool_calls=True,
                                               constraint=TWO_ADDS)
    chunks = [chunk async for chunk in stream]
    pieces = [d for c in chunks for d in c.additional_kwargs.get("tool_call_deltas", ())]
    calls: dict[int, dict[str, str]] = {}
    for piece in pieces:  # accumulated the way OpenAI clients do
        call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += piece.get("id", "")
        call["name"] += piece["function"].get("name", "")
        call["arguments"] += piece["function"]["arguments"]
    final = llm.get_tool_calls_from_response(chunks[-1])
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.tool_id, c.tool_name, c.tool_kwargs) for c in final]
    # Each call's name comes first, its arguments in fragments after; the first call is
    # whole (in the message too) before the second one starts.
    assert [len([p for p in pieces if p["index"] == i]) > 2 for i in calls] == [True, True]
    first = next(i for i, c in enumerate(chunks)
                 if llm.get_tool_calls_from_response(c, error_on_no_tool_call=False))
    second = next(i for i, c in enumerate(chunks)
                  if any(d["index"] == 1 for d in c.additional_kwargs.get("tool_call_deltas", ())))
    assert first < second < len(chunks) - 1
    early = llm.get_tool_calls_from_response(chunks[first])
    assert [(c.tool_id, c.tool_kwargs) for c in early] == [(final[0].tool_id, {"a": 1, "b": 2})]


async def test_a_repeated_call_ends_the_answer_and_is_dropped(llm: MLXBatchLLM) -> None:
    tools = [FunctionTool.from_defaults(add)]
    response = await llm.achat_with_tools(tools, user_msg="Add 1 and 2.", max_tokens=300,
                                          allow_parallel_tool_calls=True,
                                          constraint=SAME_ADD_THRICE)
    calls = llm.get_tool_calls_from_response(response)
    assert [c.tool_kwargs for c in calls] == [{"a": 1, "b": 2}]
    assert response.raw["finish_reason"] == "tool_calls"
    assert response.raw["usage"]["completion_tokens"] < 300 and not response.raw[
        "invalid_tool_calls"]
    assert response.message.content == ""


async def test_tool_required_and_named_choice_are_enforced(llm: MLXBatchLLM) -> None:
    tools = [FunctionTool.from_defaults(add), clock_tool()]
    named = await llm.achat_with_tools(tools, user_msg="Time in Tokyo?", tool_choice="get_time",
                                       max_tokens=64)
    [call] = llm.get_tool_calls_from_response(named)
    assert call.tool_name == "get_time" and call.tool_kwargs["tz"] in ("UTC", "CET", "JST")
    clock = [clock_tool()]
    required = llm.chat_with_tools(clock, user_msg="Time?", tool_required=True, max_tokens=64)
    assert [c.tool_name for c in llm.get_tool_calls_from_response(required)] == ["get_time"]
    assert required.raw["finish_reason"] == named.raw["finish_reason"] == "tool_calls"
    free = llm.chat_with_tools(clock, user_msg="Time?", max_tokens=8)
    assert llm.get_tool_calls_from_response(free, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="0 tool calls"):
        llm.get_tool_calls_from_response(free)
    with pytest.raises(ValueError, match="needs at least one tool"):
        llm.chat_with_tools([], user_msg="Time?", tool_required=True)


def test_tool_results_are_rendered_through_the_chat_template(llm: MLXBatchLLM) -> None:
    tools = [FunctionTool.from_defaults(add)]
    history = [
        ChatMessage(role=MessageRole.USER, content="Add 1 and 2, and 3 and 4."),
        ChatMessage(role=MessageRole.ASSISTANT, blocks=[
            ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 1, "b": 2}),
            ToolCallBlock(tool_call_id="c2", tool_name="add", tool_kwargs='{"a": 3, "b": 4}')]),
        ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role=MessageRole.TOOL, content="7", additional_kwargs={"tool_call_id": "c2"}),
    ]
    response = llm.chat_with_tools(tools, chat_history=history, max_tokens=4)
    expected = template_messages(messages_from_openai([
        {"role": "user", "content": "Add 1 and 2, and 3 and 4."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
            {"id": "c2", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
        {"role": "tool", "content": "7", "tool_call_id": "c2", "name": "add"},
    ]))
    schema = tools[0].metadata.to_openai_tool()
    rendered = llm.engine.tokenizer.apply_chat_template(
        expected, tools=[schema], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n3\n</tool_response>" in rendered
    assert '{"name": "add", "arguments": {"a": 3, "b": 4}}' in rendered
    tokens = llm.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert response.raw["usage"]["prompt_tokens"] == len(tokens)


# ----- structured output --------------------------------------------------------------


class Forecast(BaseModel):
    """A tiny forecast whose every field is bounded, so a random model must finish it."""

    sky: Literal["sunny", "cloudy", "rainy"]
    windy: bool
    zone: Literal["UTC", "CET"]


PROMPT = PromptTemplate("Give the forecast for {city} as JSON.")


async def test_structured_predict_is_grammar_constrained_json(
        llm: MLXBatchLLM, recorder: Recorder) -> None:
    sync = llm.structured_predict(Forecast, PROMPT, llm_kwargs={"max_tokens": 64}, city="Paris")
    assert isinstance(sync, Forecast)
    again = await llm.astructured_predict(Forecast, PROMPT, llm_kwargs={"max_tokens": 64},
                                          city="Paris")
    assert again == sync  # greedy: the same object either way
    assert any(isinstance(e, LLMStructuredPredictEndEvent) for e in recorder.events)
    partials = list(llm.stream_structured_predict(Forecast, PROMPT,
                                                  llm_kwargs={"max_tokens": 64}, city="Paris"))
    assert partials[-1] == sync
    apartials = [p async for p in await llm.astream_structured_predict(
        Forecast, PROMPT, llm_kwargs={"max_tokens": 64}, city="Paris")]
    assert apartials[-1] == sync


async def test_as_structured_llm_answers_in_the_schema(llm: MLXBatchLLM) -> None:
    structured = llm.as_structured_llm(Forecast)
    response = structured.chat(ASK, max_tokens=64)
    assert isinstance(response.raw, Forecast)
    assert Forecast.model_validate_json(response.message.content or "") == response.raw
    aresponse = await structured.achat(ASK, max_tokens=64)
    assert aresponse.raw == response.raw


CUT = r"cut at max_tokens=3 after 3 tokens before it was complete; raise max_tokens"


async def test_structured_output_cut_by_max_tokens_says_so(llm: MLXBatchLLM) -> None:
    short = {"max_tokens": 3}
    with pytest.raises(OutputTruncatedError, match="the JSON for Forecast was " + CUT):
        llm.structured_predict(Forecast, PROMPT, llm_kwargs=short, city="Paris")
    with pytest.raises(OutputTruncatedError, match=CUT):
        await llm.astructured_predict(Forecast, PROMPT, llm_kwargs=short, city="Paris")
    with pytest.raises(OutputTruncatedError, match=CUT):
        list(llm.stream_structured_predict(Forecast, PROMPT, llm_kwargs=short, city="Paris"))
    with pytest.raises(OutputTruncatedError, match=CUT):
        [p async for p in await llm.astream_structured_predict(
            Forecast, PROMPT, llm_kwargs=short, city="Paris")]
    structured = llm.as_structured_llm(Forecast)
    with pytest.raises(OutputTruncatedError, match=CUT):
        structured.chat(ASK, max_tokens=3)
    with pytest.raises(OutputTruncatedError, match=CUT):
        await structured.achat(ASK, max_tokens=3)


async def test_a_forced_call_cut_by_max_tokens_says_so(llm: MLXBatchLLM) -> None:
    clock = [clock_tool()]
    cut = "the forced tool call was " + CUT
    with pytest.raises(OutputTruncatedError, match=cut):
        llm.chat_with_tools(clock, user_msg="Time?", tool_required=True, max_tokens=3)
    with pytest.raises(OutputTruncatedError, match=cut):
        await llm.achat_with_tools(clock, user_msg="Time?", tool_choice="get_time",
                                   max_tokens=3)
    with pytest.raises(OutputTruncatedError, match=cut):
        list(llm.stream_chat_with_tools(clock, user_msg="Time?", tool_required=True,
                                        max_tokens=3))
    with pytest.raises(OutputTruncatedError, match=cut):
        [c async for c in await llm.astream_chat_with_tools(
            clock, user_msg="Time?", tool_required=True, max_tokens=3)]
    # Not forced: a call cut mid-arguments stays an invalid call in raw, as before.
    tools = [FunctionTool.from_defaults(add)]
    auto = llm.chat_with_tools(tools, user_msg="Add.", max_tokens=4, constraint=TWO_ADDS)
    assert auto.raw["finish_reason"] == "length" and len(auto.raw["invalid_tool_calls"]) == 1
    assert llm.get_tool_calls_from_response(auto, error_on_no_tool_call=False) == []


# ----- reasoning ----------------------------------------------------------------------


async def test_reasoning_comes_back_as_thinking_blocks(
        thinking_model_dir: Path, tmp_path: Path) -> None:
    model = own_copy(thinking_model_dir, tmp_path / "thinking")
    llm = MLXBatchLLM(model, max_tokens=30)
    grammar = LarkGrammar('start: <think> "let me see" </think> "It is sunny."')
    try:
        response = await llm.achat(ASK, constraint=grammar)
        thinking, text = response.message.blocks
        assert isinstance(thinking, ThinkingBlock) and thinking.content == "let me see"
        assert isinstance(text, TextBlock) and response.message.content == "It is sunny."
        chunks = list(llm.stream_chat(ASK, constraint=grammar))
        deltas = "".join(c.additional_kwargs.get("thinking_delta", "") for c in chunks)
        assert deltas == "let me see"
        assert "".join(c.delta or "" for c in chunks) == "It is sunny."
        assert isinstance(chunks[-1].message.blocks[0], ThinkingBlock)
        plain = llm.complete("Weather?", constraint=grammar)
        assert plain.text == "It is sunny." and plain.additional_kwargs["reasoning"] == "let me see"
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def qwen3_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MLXBatchLLM]:
    """MLXBatchLLM on a tiny model with Qwen3's real tokenizer and template (which renders
    the reasoning of the assistant turns after the last user turn). Fast-forward is off:
    a row that ends inside a forced span (as the fully forced turns here do) stores only
    the KV of the tokens it sampled, so its next turn would hit only its prompt."""
    try:
        model = built_family_model(FAMILIES["qwen3"], _cache_root(tmp_path_factory))
    except AssetUnavailable as exc:
        pytest.skip(f"Qwen3's tokenizer or template is missing: {exc}")
    llm = MLXBatchLLM(own_copy(model, tmp_path_factory.mktemp("li-qwen3") / "qwen3"),
                      max_tokens=64, engine_config={"fast_forward": False})
    yield llm
    llm.engine.close()


def _reasoned_call(llm: MLXBatchLLM, thought: str, a: int, b: int) -> LarkGrammar:
    """Reasoning, then one add call, in Qwen3's syntax, as the exact tokens the template
    renders them with: a real model writes those, while a random one held only to the text
    may spell it in any tokens (and no turn would find its own tokens again)."""
    call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
    text = f"<think>\n{thought}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return LarkGrammar("start: " + " ".join(f"<[{i}]>" for i in ids))


def _prompt_text(llm: MLXBatchLLM, history: list[ChatMessage], tools: list[Any]) -> str:
    """The prompt the engine renders for a LlamaIndex history, as its thread renders it."""
    request = ChatRequest.from_openai(to_engine_messages(history),
                                      tools=[t.metadata.to_openai_tool() for t in tools])
    tokenizer = llm.engine.tokenizer
    encoded = prompt_renderer(llm.engine).encode_request(
        request.messages, request.rendered_tools, {},
        history=dialect_for(TokenizerFacts.of(tokenizer)).history)
    return str(tokenizer.decode(encoded.ids))


@pytest.mark.parametrize("streamed", [False, True], ids=["chat", "astream_chat"])
async def test_an_agent_turn_replays_its_reasoning_and_reuses_the_prefix(
        qwen3_llm: MLXBatchLLM, streamed: bool) -> None:
    # What FunctionAgent does: call with tools, keep response.message (the last chunk's,
    # when streaming) in the history, add the tool result, call again.
    tools = [FunctionTool.from_defaults(add)]
    a = 2 if streamed else 1  # each case its own conversation (no reuse across them)
    history = [ChatMessage(role=MessageRole.USER, content=f"Add {a} and 5.")]
    grammar = _reasoned_call(qwen3_llm, f"the user wants {a} + 5", a, 5)
    if streamed:
        stream = await qwen3_llm.astream_chat_with_tools(tools, chat_history=history,
                                                         constraint=grammar)
        first = [chunk async for chunk in stream][-1]
    else:
        first = qwen3_llm.chat_with_tools(tools, chat_history=history, constraint=grammar)
    thinking = [b.content for b in first.message.blocks if isinstance(b, ThinkingBlock)]
    assert [(t or "").strip() for t in thinking] == [f"the user wants {a} + 5"]
    [call] = qwen3_llm.get_tool_calls_from_response(first)
    history += [first.message, ChatMessage(role=MessageRole.TOOL, content=str(a + 5),
                                           additional_kwargs={"tool_call_id": call.tool_id})]

    prompt = _prompt_text(qwen3_llm, history, tools)
    assert f"<think>\nthe user wants {a} + 5\n</think>\n\n<tool_call>" in prompt
    used = first.raw["usage"]
    whole_turn = used["prompt_tokens"] + used["completion_tokens"]
    # Without the reasoning the history diverges from the cache where it was written.
    unreasoned = first.message.model_copy(update={"blocks": [
        b for b in first.message.blocks if not isinstance(b, ThinkingBlock)]})
    dropped = qwen3_llm.chat_with_tools(tools, chat_history=[history[0], unreasoned,
                                                             history[2]], max_tokens=1)
    assert dropped.raw["usage"]["cached_tokens"] <= used["prompt_tokens"] + 1
    # Replayed, the second turn starts from the whole first one (prompt, reasoning, call).
    second = qwen3_llm.chat_with_tools(tools, chat_history=history, max_tokens=1)
    assert second.raw["usage"]["cached_tokens"] >= whole_turn


# ----- retrieval-augmented generation -------------------------------------------------

DOCS = [
    "The Zorblax fruit is bright purple and grows only on Mount Tervo.",
    "Quartz clocks keep time with a vibrating crystal.",
    "The river Ulm floods every spring after the snow melts.",
]


async def test_rag_query_engine_over_a_keyword_index(llm: MLXBatchLLM, recorder: Recorder) -> None:
    index = SimpleKeywordTableIndex.from_documents([Document(text=t) for t in DOCS], llm=llm)
    engine = index.as_query_engine(llm=llm)
    response = engine.query("Where does the Zorblax fruit grow?")
    assert [n.node.get_content() for n in response.source_nodes] == [DOCS[0]]
    prompts = [m.content or "" for e in recorder.events if isinstance(e, LLMChatStartEvent)
               for m in e.messages]
    assert any(DOCS[0] in p and "Where does the Zorblax fruit grow?" in p for p in prompts)
    [end] = [e for e in recorder.events if isinstance(e, LLMChatEndEvent)]
    assert end.response is not None and str(response) == end.response.message.content
    aresponse = await engine.aquery("When does the river Ulm flood?")
    assert [n.node.get_content() for n in aresponse.source_nodes] == [DOCS[2]]
    assert str(aresponse)


def test_json_in_raw_is_serialisable(llm: MLXBatchLLM) -> None:
    # Agents and tracing serialise responses: raw must be plain JSON data.
    response = llm.chat(ASK, max_tokens=2)
    assert json.loads(json.dumps(response.raw)) == response.raw
