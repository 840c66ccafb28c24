"""ChatMLXBatch without a model: message conversion, tools, output formats, chunks, fields."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableBinding
from langchain_core.tools import tool
from pydantic import BaseModel, Field, ValidationError
from typing_extensions import TypedDict

import mlx_providers.langchain as lc
from engine import (
    Completion,
    FinishReason,
    InvalidRequestError,
    InvalidToolCall,
    JsonObject,
    JsonSchema,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from engine.requests.inbound.messages import template_messages
from mlx_providers import ChatMLXBatch
from mlx_providers._langchain_inbound import (
    chat_messages,
    constraint_for,
    json_schema_of,
    openai_tools,
    tool_choice_name,
)
from mlx_providers._langchain_outbound import ai_message, event_chunk

CALL = {"name": "add", "args": {"a": 1, "b": 2}, "id": "abc123", "type": "tool_call"}


def rendered(messages: list[Any]) -> list[dict[str, Any]]:
    """A LangChain history as the engine renders it: converted once, then template-safe."""
    return template_messages(chat_messages(messages))


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(description="the city")
    days: int


class WeatherDict(TypedDict):
    """Weather in a city."""

    city: str


def no_engine(*_: Any, **__: Any) -> Any:
    raise AssertionError("the engine must not be touched here")


@pytest.fixture(autouse=True)
def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing in this file may create or load an engine.
    monkeypatch.setattr(lc, "get_engine", no_engine)


# ----- messages ---------------------------------------------------------------------------


def test_plain_roles_map_to_template_roles() -> None:
    out = rendered([SystemMessage("be brief"), HumanMessage("hi"), AIMessage("hello")])
    assert out == [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}]


def test_ai_message_with_tool_calls_and_empty_content() -> None:
    out = rendered([HumanMessage("1 + 2?"), AIMessage("", tool_calls=[CALL])])
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123", "type": "function",
         "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}


def test_ai_message_with_list_content_keeps_text_and_calls() -> None:
    content: list[Any] = [{"type": "text", "text": "some text"},
                          {"type": "tool_use", "id": "abc123", "name": "add", "input": {}}]
    out = rendered([HumanMessage("q"), AIMessage(content, tool_calls=[CALL])])
    assert out[1]["content"] == "some text"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_invalid_tool_calls_in_history_are_not_replayed() -> None:
    message = AIMessage("oops", invalid_tool_calls=[
        {"name": "add", "args": "{bad", "id": "x", "error": "bad json",
         "type": "invalid_tool_call"}])
    assert rendered([HumanMessage("q"), message])[1] == {"role": "assistant",
                                                             "content": "oops"}


def test_tool_message_with_string_content() -> None:
    out = rendered([HumanMessage("q"), AIMessage("", tool_calls=[CALL]),
                         ToolMessage(json.dumps({"result": 3}), name="add",
                                     tool_call_id="abc123")])
    assert out[2] == {"role": "tool", "content": '{"result": 3}', "tool_call_id": "abc123",
                      "name": "add"}


def test_tool_message_with_list_content_and_error_status() -> None:
    message = ToolMessage([{"type": "text", "text": "Missing argument 'b'."}, "Try again."],
                          tool_call_id="abc123", status="error")
    out = rendered([HumanMessage("q"), AIMessage("", tool_calls=[CALL]), message])
    assert out[2]["role"] == "tool" and out[2]["tool_call_id"] == "abc123"
    assert out[2]["content"] == "Error: Missing argument 'b'.Try again."


def test_consecutive_human_messages_are_merged() -> None:
    out = rendered([HumanMessage("hello"), HumanMessage("how are you")])
    assert out == [{"role": "user", "content": "hello\n\nhow are you"}]


def test_system_message_in_the_middle_keeps_its_text_as_a_user_turn() -> None:
    out = rendered([HumanMessage("a"), AIMessage("b"), SystemMessage("be brief"),
                         HumanMessage("c")])
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[2]["content"] == "[system] be brief\n\nc"


def test_names_are_kept_and_named_turns_are_not_merged() -> None:
    out = rendered([HumanMessage("hi", name="alice"), HumanMessage("yo", name="bob")])
    assert out == [{"role": "user", "content": "hi", "name": "alice"},
                   {"role": "user", "content": "yo", "name": "bob"}]


def test_legacy_function_message_is_a_tool_result() -> None:
    out = rendered([HumanMessage("q"), FunctionMessage("3", name="add")])
    assert out[1] == {"role": "tool", "content": "3", "name": "add"}


def test_double_system_and_double_ai_messages_do_not_raise() -> None:
    out = rendered([SystemMessage("s"), SystemMessage("s"), HumanMessage("h"),
                         HumanMessage("h"), AIMessage("a"), AIMessage("a"), HumanMessage("q")])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "assistant", "user"]


def test_media_parts_are_refused_by_the_rulebook_naming_the_part() -> None:
    # The one rulebook refuses what it cannot read at every door (LangChain used to drop
    # media silently): audio that is not audio, and an image it would have to fetch.
    content: list[Any] = [{"type": "text", "text": "describe"},
                          {"type": "input_audio", "input_audio": {"data": ""}}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[1\]: not "
                                                  "readable audio") as caught:
        rendered([HumanMessage(content)])
    assert caught.value.field == "messages[0].content[1]"
    remote = [{"type": "image", "url": "https://example.com/cat.png"}]
    with pytest.raises(InvalidRequestError, match="not fetched") as caught:
        rendered([HumanMessage(remote)])
    assert caught.value.field == "messages[0].content[0]"


# ----- tools ------------------------------------------------------------------------------


def test_any_tool_shape_becomes_an_openai_tool() -> None:
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    raw = {"type": "function", "function": {"name": "raw", "parameters": {"type": "object"}}}
    tools = openai_tools([add, Weather, multiply, raw, WeatherDict])
    assert [t["function"]["name"] for t in tools] == ["add", "Weather", "multiply", "raw",
                                                       "WeatherDict"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert all(t["type"] == "function" for t in tools)


@pytest.mark.parametrize(("choice", "expected"), [
    (None, None), ("auto", "auto"), ("none", "none"), ("any", "required"),
    ("required", "required"), (True, "required"), (False, "none"), ("add", "add"),
    ({"type": "function", "function": {"name": "add"}}, "add"),
    ({"type": "tool", "name": "add"}, "add"),
])
def test_tool_choice_spellings(choice: Any, expected: str | None) -> None:
    assert tool_choice_name(choice, openai_tools([add])) == expected


def test_tool_choice_naming_an_unbound_tool_raises_at_bind_time() -> None:
    with pytest.raises(ValueError, match="not among the bound tools"):
        ChatMLXBatch().bind_tools([add], tool_choice="subtract")


def test_bind_tools_binds_openai_tools_and_the_normalised_choice() -> None:
    bound = ChatMLXBatch().bind_tools([add, Weather], tool_choice="any",
                                      parallel_tool_calls=False)
    assert isinstance(bound, RunnableBinding)
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["add", "Weather"]
    assert bound.kwargs["tool_choice"] == "required"
    assert bound.kwargs["parallel_tool_calls"] is False


# ----- output formats -----------------------------------------------------------------------


def test_json_schema_of_each_schema_kind() -> None:
    assert json_schema_of(Weather)["required"] == ["city", "days"]
    assert json_schema_of(WeatherDict)["properties"] == {"city": {"type": "string"}}
    untitled = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert json_schema_of(untitled) == untitled
    tool_dict = openai_tools([Weather])[0]
    assert json_schema_of(tool_dict)["properties"]["days"] == {"type": "integer"}


def test_response_format_becomes_a_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert constraint_for({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                          ) == JsonSchema(schema)
    assert constraint_for({"type": "json_object"}) == JsonObject()
    assert constraint_for({"type": "text"}) is None
    assert constraint_for(Weather) == JsonSchema(Weather.model_json_schema())
    with pytest.raises(ValueError, match="response_format type"):
        constraint_for({"type": "yaml"})


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_structured_output_binds_a_grammar_constraint(method: str) -> None:
    runnable = ChatMLXBatch().with_structured_output(Weather, method=method)  # type: ignore[arg-type]
    binding = runnable.first  # type: ignore[attr-defined]
    expected = JsonSchema(Weather.model_json_schema()) if method == "json_schema" else JsonObject()
    assert binding.kwargs["response_format"] == expected
    assert binding.kwargs["ls_structured_output_format"]["schema"] is Weather


def test_structured_output_by_function_calling_forces_the_schema_tool() -> None:
    runnable = ChatMLXBatch().with_structured_output(WeatherDict, method="function_calling")
    binding = runnable.first  # type: ignore[attr-defined]
    assert binding.kwargs["tool_choice"] == "WeatherDict"
    assert binding.kwargs["parallel_tool_calls"] is False


def test_structured_output_rejects_unknown_methods_and_arguments() -> None:
    with pytest.raises(ValueError, match="method must be"):
        ChatMLXBatch().with_structured_output(Weather, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported arguments"):
        ChatMLXBatch().with_structured_output(Weather, fallback="text")
    with pytest.raises(ValueError, match="needs a schema"):
        ChatMLXBatch().with_structured_output(None, method="json_schema")


# ----- results and chunks -----------------------------------------------------------------


USAGE = Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=4,
              time_to_first_token=0.5, decode_tokens_per_second=20.0, reasoning_tokens=3)


def completion(**kw: Any) -> Completion:
    fields: dict[str, Any] = {"text": "Hi", "token_ids": (1, 2), "finish_reason": FinishReason.STOP,
                              "usage": USAGE, "content": "Hi"}
    return Completion(**{**fields, **kw})


def test_ai_message_carries_calls_usage_reasoning_and_metadata() -> None:
    message = ai_message(completion(
        reasoning="hmm", tool_calls=(ToolCall("c1", "add", {"a": 1, "b": 2}),),
        invalid_tool_calls=(InvalidToolCall("c2", None, "{bad", "JSONDecodeError"),)), "m")
    assert message.content == "Hi"
    assert message.additional_kwargs == {"reasoning_content": "hmm"}
    assert message.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1",
                                   "type": "tool_call"}]
    assert message.invalid_tool_calls[0]["args"] == "{bad"
    assert message.invalid_tool_calls[0]["error"] == "JSONDecodeError"
    assert message.usage_metadata == {"input_tokens": 12, "output_tokens": 5,
                                      "total_tokens": 17,
                                      "input_token_details": {"cache_read": 4},
                                      "output_token_details": {"reasoning": 3}}
    assert message.response_metadata["model_name"] == "m"
    assert message.response_metadata["model_provider"] == "mlx"
    assert message.response_metadata["finish_reason"] == "stop"


def test_steps_without_content_make_no_chunk() -> None:
    assert event_chunk(StreamEvent("<tool_call>", (5,)), "m") is None
    chunk = event_chunk(StreamEvent("x", (5,), content="", reasoning="think"), "m")
    assert chunk is not None and chunk.message.additional_kwargs == {
        "reasoning_content": "think"}


def test_chunks_add_up_to_one_message_with_usage_counted_once() -> None:
    final = completion(
        text="Hi there", content="Hi there",
        tool_calls=(ToolCall("c1", "add", {"a": 1, "b": 2}),),
        invalid_tool_calls=(InvalidToolCall("c2", None, '{"name": "add", "arguments": {"a"',
                                            "the tool call was not closed"),))
    kept = ToolCallDelta(0, "c1", "add", '{"a": 1, "b": 2}')  # as the engine streams the call
    events = [StreamEvent("Hi", (1,), content="Hi"), StreamEvent(" there", (2,), content=" there"),
              StreamEvent("", (), finish_reason=FinishReason.STOP, usage=USAGE, completion=final,
                          tool_call_deltas=(kept,))]
    chunks = [c for e in events if (c := event_chunk(e, "m")) is not None]
    assert [c.message.usage_metadata is not None for c in chunks] == [False, False, True]
    assert chunks[-1].message.chunk_position == "last"  # type: ignore[attr-defined]
    full = chunks[0].message
    for chunk in chunks[1:]:
        full = full + chunk.message  # type: ignore[operator]
    assert isinstance(full, AIMessageChunk)
    assert full.content == "Hi there"
    assert full.usage_metadata is not None and full.usage_metadata["input_tokens"] == 12
    assert full.response_metadata["model_name"] == "m"
    assert full.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1",
                                "type": "tool_call"}]
    # The cut-off call stays invalid even though its text parses as partial JSON.
    assert [c["id"] for c in full.invalid_tool_calls] == ["c2"]


def test_a_step_is_one_chunk_per_call_and_a_streamed_invalid_call_is_not_sent_again() -> None:
    """A step's name delta and first fragment are one tool_call_chunk (LangChain merges
    same-index entries across chunks only); an invalid call whose pieces streamed (cut by
    max_tokens) is not re-sent in the last chunk, and a never-streamed one comes after every
    streamed index."""
    final = completion(
        finish_reason=FinishReason.LENGTH,
        tool_calls=(ToolCall("c1", "add", {"a": 1}, '{"a": 1}'),),
        invalid_tool_calls=(InvalidToolCall("c2", "add", '{"name": "add", "arguments": {"a": 2',
                                            "the tool call was not closed", 1),
                            InvalidToolCall("c3", None, "{bad", "JSONDecodeError")))
    events = [StreamEvent("", (1,), tool_call_deltas=(
                  ToolCallDelta(0, "c1", "add", ""), ToolCallDelta(0, arguments='{"a"'))),
              StreamEvent("", (2,), tool_call_deltas=(
                  ToolCallDelta(0, arguments=": 1}"), ToolCallDelta(1, "c2", "add", ""),
                  ToolCallDelta(1, arguments='{"a": 2'))),
              StreamEvent("", (), finish_reason=FinishReason.LENGTH, usage=USAGE,
                          completion=final)]
    chunks = [c for e in events if (c := event_chunk(e, "m")) is not None]
    assert [[(t["index"], t["id"], t["args"]) for t in c.message.tool_call_chunks]  # type: ignore[attr-defined]
            for c in chunks] == [[(0, "c1", '{"a"')], [(0, None, ": 1}"), (1, "c2", '{"a": 2')],
                                 [(2, "c3", json.dumps("{bad"))]]  # quoted: stays invalid


# ----- the model's fields ----------------------------------------------------------------


def test_construction_is_cheap_and_touches_no_engine() -> None:
    chats = [ChatMLXBatch(model=f"/models/m{i}", max_tokens=8) for i in range(10)]
    assert chats[3].model_name == "/models/m3"
    with pytest.raises(AssertionError, match="must not be touched"):
        _ = chats[0].engine


def test_fields_validate_at_construction() -> None:
    assert ChatMLXBatch(model=Path("/models/x")).model == "/models/x"
    assert ChatMLXBatch().model_name == "SmolLM2-135M-Instruct"
    with pytest.raises(ValidationError):
        ChatMLXBatch(engine_config={"max_batch": 0})
    with pytest.raises(ValidationError):
        ChatMLXBatch(engine_config={"not_a_knob": 1})
    with pytest.raises(ValidationError):
        ChatMLXBatch(temperature=-1)


def test_remote_only_arguments_are_ignored_and_unknown_ones_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ChatMLXBatch(api_key="x", max_retries=2, base_url="http://nowhere")
    with pytest.warns(UserWarning, match="temprature"):
        ChatMLXBatch(temprature=0.5)


def test_tracing_params_name_the_provider_model_and_sampling() -> None:
    chat = ChatMLXBatch(model="/models/qwen", temperature=0.3, max_tokens=32, stop=["END"])
    params = chat._get_ls_params()
    assert params["ls_provider"] == "mlx" and params["ls_model_name"] == "/models/qwen"
    assert params["ls_temperature"] == 0.3 and params["ls_max_tokens"] == 32
    assert params["ls_stop"] == ["END"]
    assert chat._get_ls_params(model="/models/other")["ls_model_name"] == "/models/other"
    assert chat._identifying_params["model_name"] == "/models/qwen"
    assert chat._llm_type == "mlx-batch-chat"


def test_profile_declares_capabilities_without_loading() -> None:
    profile = ChatMLXBatch().profile
    assert profile is not None
    assert profile["tool_calling"] and profile["tool_choice"] and profile["structured_output"]
    assert not profile["image_inputs"]


def test_reasoning_switch_becomes_a_chat_template_argument() -> None:
    assert ChatMLXBatch(reasoning=True)._template_kwargs(None, None) == {"enable_thinking": True}
    assert ChatMLXBatch(chat_template_kwargs={"a": 1})._template_kwargs(False, {"b": 2}) == {
        "enable_thinking": False, "a": 1, "b": 2}
    assert ChatMLXBatch()._template_kwargs(None, None) == {}


class FakeEngine:
    """Stands in for the shared engine to look at the request a call builds."""


def test_call_kwargs_override_fields_and_unknown_ones_raise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, dict[str, Any]]] = []
    fake = FakeEngine()
    monkeypatch.setattr(lc, "get_engine", lambda model, **cfg: seen.append((model, cfg)) or fake)
    chat = ChatMLXBatch(model="/m", temperature=0.5, max_tokens=10, stop=["x"], reasoning=False,
                        engine_config={"max_batch": 4})
    request = chat._request([HumanMessage("hi")], None, {
        "max_tokens": 3, "response_format": {"type": "json_object"}, "tools": [],
        "chat_template_kwargs": {"custom": 1}})
    assert request.engine is fake and seen == [("/m", {"max_batch": 4})]
    # The call's engine request is one typed ChatRequest (no tools: none, choice "auto").
    assert request.chat.params.max_tokens == 3 and request.chat.params.temperature == 0.5
    assert request.chat.params.stop == ("x",) and request.chat.params.constraint == JsonObject()
    assert request.chat.template_kwargs == {"enable_thinking": False, "custom": 1}
    assert request.chat.tools == () and request.chat.tool_choice == "auto"
    assert chat._request([HumanMessage("hi")], ["y"], {}).chat.params.stop == ("y",)
    override = chat._request([HumanMessage("hi")], None, {"model": "/other"})
    assert override.model_name == "/other" and not override.is_own_model
    with pytest.raises(TypeError, match="frequency_penalty"):
        chat._request([HumanMessage("hi")], None, {"frequency_penalty": 1.0})


def test_past_reasoning_is_replayed_to_the_template() -> None:
    from mlx_providers._langchain_inbound import chat_messages

    kept = AIMessage("It is sunny.", additional_kwargs={"reasoning_content": "look it up"})
    v1 = AIMessage([{"type": "reasoning", "reasoning": "think"},
                    {"type": "text", "text": "Hi"}])
    converted = chat_messages([HumanMessage("Weather?"), kept, HumanMessage("And?"), v1])
    assert converted[1].as_openai()["reasoning_content"] == "look it up"
    assert converted[1].content == "It is sunny."
    assert converted[3].as_openai()["reasoning_content"] == "think"
    assert converted[3].content == "Hi"
    assert "reasoning_content" not in chat_messages([AIMessage("plain")])[0].as_openai()
