"""LlamaIndex message conversion and tool selections, without a model."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    ChatResponse,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.tools import FunctionTool

from engine import Completion, FinishReason, StreamEvent, ToolCall, Usage
from engine.requests.inbound.messages import template_messages
from mlx_providers._llama_index_inbound import to_engine_messages
from mlx_providers._llama_index_outbound import StreamChunks, chat_response
from mlx_providers._llama_index_tools import keep_first_call, openai_tool, tool_selections


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b



def rendered(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A LlamaIndex history as the engine renders it: converted once, then template-safe."""
    return template_messages(to_engine_messages(messages))

def test_history_with_calls_results_and_late_system_text_is_template_safe() -> None:
    history = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="Add 1 and 2."),
        ChatMessage(role=MessageRole.ASSISTANT, blocks=[
            ThinkingBlock(content="the user wants a sum"),
            TextBlock(text="Calling."),
            ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs='{"a": 1, "b": 2}')]),
        ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role=MessageRole.SYSTEM, content="Now answer."),
    ]
    assert rendered(history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "the user wants a sum",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
        {"role": "user", "content": "[system] Now answer."},
    ]


def test_past_reasoning_is_replayed_as_reasoning_content_not_as_text() -> None:
    user = ChatMessage(role=MessageRole.USER, content="Weather?")
    blocks = ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        ThinkingBlock(content="look it up"), TextBlock(text="It is sunny."),
        ThinkingBlock(content="then be brief")])
    kept = ChatMessage(role=MessageRole.ASSISTANT, content="Hi",
                       additional_kwargs={"reasoning_content": "greet back"})
    vllm = ChatMessage(role=MessageRole.ASSISTANT, content="Hi",
                       additional_kwargs={"reasoning": "say hi"})
    chatbot = ChatMessage(role=MessageRole.CHATBOT, blocks=[
        ThinkingBlock(content="other integration"), TextBlock(text="Yes.")])
    for message, reasoning, text in [
            (blocks, "look it up\nthen be brief", "It is sunny."), (kept, "greet back", "Hi"),
            (vllm, "say hi", "Hi"), (chatbot, "other integration", "Yes.")]:
        [_, turn] = rendered([user, message])
        assert turn == {"role": "assistant", "content": text, "reasoning_content": reasoning}
    # A ThinkingBlock wins over additional_kwargs (it is what the response carried).
    both = blocks.model_copy(update={"additional_kwargs": {"reasoning_content": "stale"}})
    assert rendered([user, both])[1]["reasoning_content"] == "look it up\nthen be brief"


def test_empty_or_foreign_reasoning_adds_nothing() -> None:
    user = ChatMessage(role=MessageRole.USER, content="Weather?")
    for message in [
            ChatMessage(role=MessageRole.ASSISTANT, content="plain"),
            ChatMessage(role=MessageRole.ASSISTANT, blocks=[
                ThinkingBlock(content=""), ThinkingBlock(), TextBlock(text="plain")]),
            ChatMessage(role=MessageRole.ASSISTANT, content="plain",
                        additional_kwargs={"reasoning_content": "", "reasoning": None}),
            ChatMessage(role=MessageRole.ASSISTANT, content="plain",
                        additional_kwargs={"reasoning": {"effort": "low"}})]:
        assert rendered([user, message])[1] == {"role": "assistant", "content": "plain"}
    # Only assistant turns replay reasoning: a user's stray key is not a template field.
    odd = ChatMessage(role=MessageRole.USER, content="Hi",
                      additional_kwargs={"reasoning_content": "not mine"})
    assert rendered([odd]) == [{"role": "user", "content": "Hi"}]


def test_a_response_appended_to_the_history_replays_its_reasoning() -> None:
    completion = Completion(
        text="<think>sum it</think>", token_ids=(1, 2), finish_reason=FinishReason.TOOL_CALLS,
        usage=Usage(prompt_tokens=7, completion_tokens=2), content="", reasoning="sum it",
        tool_calls=(ToolCall("c1", "add", {"a": 1, "b": 2}),))
    user = ChatMessage(role=MessageRole.USER, content="Add 1 and 2.")
    result = ChatMessage(role=MessageRole.TOOL, content="3",
                         additional_kwargs={"tool_call_id": "c1"})
    whole = chat_response(completion, "tiny").message
    # A streamed turn: an agent keeps the last chunk's message, which must carry it too.
    chunks = StreamChunks("tiny")
    events = [StreamEvent("sum ", reasoning="sum "), StreamEvent("it", reasoning="it"),
              StreamEvent("", completion=completion)]
    last = [c for c in map(chunks.chat, events) if c is not None][-1]
    for message in (whole, last.message):
        assert rendered([user, message, result])[1] == {
            "role": "assistant", "content": "", "reasoning_content": "sum it",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}


def test_openai_style_calls_in_additional_kwargs_are_read_once() -> None:
    legacy = {"id": "c9", "type": "function",
              "function": {"name": "add", "arguments": '{"a": 5, "b": 6}'}}
    both = ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        ToolCallBlock(tool_call_id="c9", tool_name="add", tool_kwargs={"a": 5, "b": 6})],
        additional_kwargs={"tool_calls": [legacy]})
    [converted] = rendered([both])
    assert [c["id"] for c in converted["tool_calls"]] == ["c9"]
    only_legacy = ChatMessage(role=MessageRole.ASSISTANT, content="",
                              additional_kwargs={"tool_calls": [legacy]})
    [selection] = tool_selections(only_legacy)
    assert (selection.tool_id, selection.tool_name, selection.tool_kwargs) == (
        "c9", "add", {"a": 5, "b": 6})


def test_failed_tool_results_are_marked_as_errors() -> None:
    result = ChatMessage(role=MessageRole.TOOL, content="boom",
                         additional_kwargs={"tool_call_id": "c1", "is_error": True})
    [converted] = rendered([result])
    assert converted["content"] == "Error: boom"


def test_media_blocks_are_refused_not_dropped() -> None:
    # An image the engine would have to fetch is refused, naming the part; other media by
    # the block they were.
    picture = ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://x/y.png")])
    with pytest.raises(ValueError, match=r"content\[0\]: remote image URLs are not fetched"):
        to_engine_messages([picture])
    sound = ChatMessage(role=MessageRole.USER, blocks=[AudioBlock(audio=b"RIFF....")])
    with pytest.raises(ValueError, match=r"content\[0\]: not readable audio"):
        to_engine_messages([sound])
    document = ChatMessage(role=MessageRole.USER, blocks=[DocumentBlock(data=b"%PDF-1.4")])
    with pytest.raises(ValueError, match="DocumentBlock"):
        to_engine_messages([document])


def test_calls_without_ids_still_get_distinct_tool_ids() -> None:
    message = ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        ToolCallBlock(tool_name="add", tool_kwargs={"a": 1, "b": 2}),
        ToolCallBlock(tool_name="add", tool_kwargs={"a": 1, "b": 2})])
    ids = [s.tool_id for s in tool_selections(message)]
    assert len(set(ids)) == 2 and all(ids)


def test_responses_keep_calls_as_blocks_and_can_drop_extra_calls() -> None:
    completion = Completion(
        text="...", token_ids=(1, 2), finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=7, completion_tokens=2), content="\n", reasoning="hmm",
        tool_calls=(ToolCall("c1", "add", {"a": 1, "b": 2}), ToolCall("c2", "add", {"a": 3})))
    response = chat_response(completion, "tiny")
    thinking, text, *calls = response.message.blocks
    assert isinstance(thinking, ThinkingBlock) and thinking.content == "hmm"
    assert isinstance(text, TextBlock) and text.text == ""  # newlines between calls dropped
    assert [c.tool_call_id for c in calls if isinstance(c, ToolCallBlock)] == ["c1", "c2"]
    assert response.raw["usage"]["total_tokens"] == 9
    single = keep_first_call(response)
    assert [s.tool_id for s in tool_selections(single.message)] == ["c1"]
    assert isinstance(single, ChatResponse) and len(tool_selections(response.message)) == 2


def test_tools_become_openai_function_schemas() -> None:
    schema = openai_tool(FunctionTool.from_defaults(add))
    assert schema["function"]["name"] == "add"
    assert set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
    assert openai_tool(schema) == schema
    with pytest.raises(TypeError, match="LlamaIndex tool"):
        openai_tool(object())


def test_media_of_every_kind_is_converted_off_the_event_loop() -> None:
    from llama_index.core.base.llms.types import VideoBlock

    from mlx_providers._llama_index_inbound import carries_images

    def user(block: Any) -> list[ChatMessage]:
        return [ChatMessage(role=MessageRole.USER, blocks=[block, TextBlock(text="hi")])]

    assert carries_images(user(ImageBlock(image=b"x")))
    assert carries_images(user(VideoBlock(video=b"x")))  # probed: a worker thread's job
    assert carries_images(user(AudioBlock(audio=b"x")))  # decoded: likewise
    assert not carries_images(user(TextBlock(text="only text")))
