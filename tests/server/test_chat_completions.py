"""``/v1/chat/completions`` through the ``openai`` SDK on a real loopback server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest

from engine import Engine
from tests.server.conftest import LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    # Short closed values: a random-weight model fills free strings until max_tokens.
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
HI = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def test_models_lists_only_what_the_server_serves(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_completion_has_content_finish_reason_and_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=7)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_a_stream_tells_the_same_text_with_usage_last(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=12, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_without_include_usage_no_chunk_carries_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=4,  # type: ignore[arg-type]
                                                 stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


async def test_async_clients_share_one_batch(live_server: LiveServer,
                                             server_engine: Engine) -> None:
    client = openai.AsyncOpenAI(base_url=live_server.base_url, api_key="unused",
                                max_retries=0, timeout=60)
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(6)]
    alone = [(await client.chat.completions.create(model="tiny", messages=p, max_tokens=40)  # type: ignore[arg-type]
              ).choices[0].message.content for p in prompts[:2]]
    before = server_engine.stats().peak_running
    results = await asyncio.gather(*(client.chat.completions.create(
        model="tiny", messages=p, max_tokens=40) for p in prompts))  # type: ignore[arg-type]
    assert [r.choices[0].message.content for r in results[:2]] == alone  # batching is exact
    assert server_engine.stats().peak_running >= max(before, 2)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_choice_returns_valid_calls(client: openai.OpenAI, choice: Any) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200)  # type: ignore[list-item]
    calls = r.choices[0].message.tool_calls
    assert calls, r
    assert r.choices[0].finish_reason == "tool_calls"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in tools
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_time"}


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}],  # type: ignore[arg-type]
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,  # type: ignore[list-item]
        max_tokens=200)
    assert len(r.choices[0].message.tool_calls or ()) == 1


def test_streamed_tool_calls_accumulate_with_stable_ids(client: openai.OpenAI) -> None:
    """A call's first delta has its id, type and name (arguments ""), argument fragments
    follow; accumulated by index they are the non-streamed calls."""
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],  # type: ignore[arg-type, list-item]
        tool_choice="required", max_tokens=200)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],  # type: ignore[arg-type, list-item]
        tool_choice="required", max_tokens=200, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    firsts = [d for d in deltas if d.id is not None]
    assert firsts and all(d.id and d.id.startswith("call_") and d.type == "function"
                          for d in firsts)
    assert len({d.id for d in firsts}) == len(firsts) == len({d.index for d in deltas})
    assert all(d.function and d.function.name and d.function.arguments == "" for d in firsts)
    assert len(deltas) > len(firsts)  # the arguments came in fragments after the name
    accumulated: dict[int, list[str]] = {}
    for d in deltas:
        assert d.function is not None
        name, arguments = accumulated.setdefault(d.index, ["", ""])
        accumulated[d.index] = [name + (d.function.name or ""),
                                arguments + (d.function.arguments or "")]
    expected = whole.choices[0].message.tool_calls or []
    assert [tuple(v) for _, v in sorted(accumulated.items())] == [
        (c.function.name, c.function.arguments) for c in expected]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_makes_no_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],  # type: ignore[arg-type, list-item]
        tool_choice="none", max_tokens=10)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"


def test_tool_results_continue_the_conversation(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],  # type: ignore[list-item]
                                       max_tokens=8)
    assert r.usage is not None and r.usage.prompt_tokens > 40  # the history was rendered


def test_json_schema_response_format_is_enforced(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A person."}], max_tokens=60,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(value, {**schema, "additionalProperties": False})


def test_json_object_response_format_gives_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please."}], max_tokens=200,  # type: ignore[arg-type]
        response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert (r.choices[0].message.content or "").startswith("{")


def test_structured_output_through_the_sdk_parse_helper(client: openai.OpenAI) -> None:
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Literal["Paris", "Oslo", "Rome"]
        population: int = Field(ge=1, le=9)

    r = client.chat.completions.parse(model="tiny", messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "A city."}], response_format=City, max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, City)


def test_stop_strings_end_the_answer_before_them(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=HI, max_tokens=30)  # type: ignore[arg-type]
    text = full.choices[0].message.content or ""
    stop = text[10:14]
    assert stop.strip(), text
    cut = client.chat.completions.create(model="tiny", messages=HI, max_tokens=30, stop=[stop])  # type: ignore[arg-type]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_seeded_sampling_reproduces(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        return client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=16, temperature=1.0, seed=seed,  # type: ignore[arg-type]
        ).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    # (Token texts are not compared with the content: the tiny model's padded vocabulary
    # has ids no tokenizer entry decodes.)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.logprob - 1e-5  # greedy: the top one
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=6,  # type: ignore[arg-type]
                                                 logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or ()]
    assert [t.token for t in streamed] == [t.token for t in content]
