"""Llama 3's JSON calls read into content and calls (no model): the whole answer is the
call object, ended by the end-of-turn token, fed whole and a character at a time."""

from __future__ import annotations

import json

import pytest

from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.llama3 import Llama3, Llama3Splitter
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.tool_calls import ToolCallDelta
from tests.unit.test_harmony import TOOLS, WEATHER

CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TEMPLATE = ('<|start_header_id|>system<|end_header_id|>\n\n'
                  'Respond in the format {"name": function name, "parameters": dictionary}')


def read(text: str, *, by_char: bool = False, parallel: bool = True) -> RowChannels:
    channels = RowChannels(Llama3Splitter(), None, TOOLS, parallel)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


def calls_of(channels: RowChannels) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, c.arguments) for c in channels.calls]


@pytest.mark.parametrize("text", [CALL, "<|python_tag|>" + CALL, " \n" + CALL + "\n",
                                  '{ "name" : "get_weather", "parameters": {"city": "Paris"}}'])
@pytest.mark.parametrize("by_char", [False, True])
def test_a_call_object_is_a_call_and_no_markup_is_content(text: str, by_char: bool) -> None:
    channels = read(text, by_char=by_char)
    assert calls_of(channels) == [("get_weather", {"city": "Paris"})]
    assert channels.content == "" and not channels.invalid
    assert channels.calls[0].arguments_text == '{"city": "Paris"}'  # the model's own text


@pytest.mark.parametrize("by_char", [False, True])
def test_calls_separated_by_semicolons_are_several_calls(by_char: bool) -> None:
    other = CALL.replace("Paris", "Oslo")
    channels = read(f"{CALL}; {other}", by_char=by_char)
    assert [c.arguments["city"] for c in channels.calls] == ["Paris", "Oslo"]
    assert channels.content == ""
    assert [c.arguments["city"] for c in read(f"{CALL}; {other}", parallel=False).calls] == [
        "Paris"]


@pytest.mark.parametrize("text", ["It is sunny in Paris.", '{"answer": 42}', "{}",
                                  "The JSON is {\"name\": \"x\"}"])
@pytest.mark.parametrize("by_char", [False, True])
def test_an_answer_is_content_even_when_it_is_json(text: str, by_char: bool) -> None:
    channels = read(text, by_char=by_char)
    assert channels.content == text and not channels.calls and not channels.invalid


def test_the_arguments_stream_in_fragments_that_add_up() -> None:
    channels = RowChannels(Llama3Splitter(), None, TOOLS)
    deltas: list[ToolCallDelta] = []
    for ch in CALL:
        channels.feed(ch)
        deltas += channels.take_deltas()
    channels.finish()
    deltas += channels.take_deltas()
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris"}'


def test_a_call_cut_by_the_end_of_the_row_is_invalid() -> None:
    channels = read(CALL[:-5])
    assert not channels.calls
    [invalid] = channels.invalid
    assert invalid.name == "get_weather"


def test_code_after_the_python_tag_is_an_invalid_call_not_content() -> None:
    channels = read('<|python_tag|>brave_search.call(query="Paris")')
    assert not channels.calls and len(channels.invalid) == 1 and channels.content == ""


def test_text_then_the_python_tag_then_a_call() -> None:
    channels = read("Let me check.<|python_tag|>" + CALL, by_char=True)
    assert channels.content == "Let me check." and len(channels.calls) == 1


def test_a_llama_template_speaks_llama3() -> None:
    facts = TokenizerFacts(chat_template=LLAMA_TEMPLATE, vocab={"<|python_tag|>": 1})
    assert isinstance(dialect_for(facts), Llama3)
    assert not isinstance(dialect_for(TokenizerFacts(chat_template=LLAMA_TEMPLATE)), Llama3)


def test_the_forced_call_is_the_templates_call_object() -> None:
    get_time = json.loads(json.dumps(WEATHER).replace("get_weather", "get_time"))
    tools = normalize_tools([WEATHER, get_time])
    dialect = Llama3(TokenizerFacts())
    lark = dialect.forced_calls(tools, "get_time", False, json.dumps)
    assert lark.startswith("calls: call\ncall: call_0\n")
    assert '"{\\"name\\": \\"get_time\\", \\"parameters\\": " args_0 "}"' in lark
    assert "get_weather" not in lark
    assert 'calls: call ("; " call)*' in dialect.forced_calls(tools, "required", True,
                                                              json.dumps)


def test_a_multi_call_turn_becomes_one_turn_per_call() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "c2"}]}
    history = Llama3(TokenizerFacts()).history([{"role": "user", "content": "hi"}, turn])
    assert [m["role"] for m in history] == ["user", "assistant", "assistant"]
    assert [[c["id"] for c in m["tool_calls"]] for m in history[1:]] == [["c1"], ["c2"]]
