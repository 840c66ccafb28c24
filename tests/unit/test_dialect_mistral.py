"""Mistral's ``[TOOL_CALLS]`` calls and ``[THINK]`` reasoning read into channels (no model),
fed whole and a character at a time; its call ids and forced calls."""

from __future__ import annotations

import json
import re

import pytest

from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.marked_calls import MarkedCallSplitter
from engine.requests.dialects.mistral import SYNTAX, Mistral, template_call_id
from engine.requests.dialects.registry import dialect_for
from engine.requests.outbound.channels import CONTENT, REASONING
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.tool_calls import ToolCallDelta
from tests.unit.test_harmony import TOOLS

WITH_ID = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
WITHOUT_ID = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
VOCAB = {"[TOOL_CALLS]": 9, "[ARGS]": 32, "[CALL_ID]": 33, "[THINK]": 34, "[/THINK]": 35}
SMALL_3_2 = Mistral(TokenizerFacts(chat_template="[TOOL_CALLS][CALL_ID][ARGS]", vocab=VOCAB))
MINISTRAL = Mistral(TokenizerFacts(chat_template="[THINK][TOOL_CALLS][ARGS]", vocab=VOCAB))


def read(text: str, *, by_char: bool = False, dialect: Mistral = MINISTRAL,
         start: str = CONTENT) -> RowChannels:
    channels = RowChannels(dialect.splitter(start), dialect.parser, TOOLS,
                           new_id=dialect.new_call_id)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


@pytest.mark.parametrize("call", [WITH_ID, WITHOUT_ID,
                                  '[TOOL_CALLS][{"name": "get_weather", '
                                  '"arguments": {"city": "Paris"}}]'])
@pytest.mark.parametrize("by_char", [False, True])
def test_each_call_form_is_a_call_and_no_markup_is_content(call: str, by_char: bool) -> None:
    channels = read(call, by_char=by_char)
    assert [(c.name, c.arguments) for c in channels.calls] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert channels.content == "" and not channels.invalid
    assert re.fullmatch(r"[A-Za-z0-9]{9}", channels.calls[0].id)


@pytest.mark.parametrize("by_char", [False, True])
def test_reasoning_then_two_calls(by_char: bool) -> None:
    text = "[THINK]Weather in two cities.[/THINK]" + WITHOUT_ID + WITH_ID.replace(
        "Paris", "Oslo")
    channels = read(text, by_char=by_char)
    assert channels.reasoning == "Weather in two cities."
    assert [c.arguments["city"] for c in channels.calls] == ["Paris", "Oslo"]
    assert channels.content == ""


def test_the_arguments_stream_in_fragments_that_add_up() -> None:
    channels = RowChannels(MINISTRAL.splitter(), None, TOOLS)
    deltas: list[ToolCallDelta] = []
    for ch in WITH_ID:
        channels.feed(ch)
        deltas += channels.take_deltas()
    channels.finish()
    deltas += channels.take_deltas()
    assert deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas[1:]) == '{"city": "Paris"}'
    assert len(deltas) > 4


def test_an_answer_with_brackets_is_content() -> None:
    channels = read("Use [ARGS] like [this].", by_char=True)
    assert channels.content == "Use [ARGS] like [this]." and not channels.calls


@pytest.mark.parametrize("cut", [WITH_ID[:-3], "[TOOL_CALLS]get_wea", "[TOOL_CALLS]"])
def test_a_cut_call_is_invalid_never_content(cut: str) -> None:
    channels = read(cut)
    assert not channels.calls and len(channels.invalid) == 1 and channels.content == ""


def test_without_think_in_the_template_think_is_text() -> None:
    channels = read("[THINK]x[/THINK]y", dialect=SMALL_3_2)
    assert channels.content == "[THINK]x[/THINK]y" and channels.reasoning == ""
    assert read("x[/THINK]y", start=REASONING).reasoning == "x"


def test_call_ids_are_nine_alphanumerics_and_foreign_ids_map_stably() -> None:
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", MINISTRAL.new_call_id()) for _ in range(20))
    assert template_call_id("a1b2c3d4e") == "a1b2c3d4e"
    mapped = template_call_id("call_0123456789abcdef01234567")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped)
    assert mapped == template_call_id("call_0123456789abcdef01234567")
    assert mapped != template_call_id("call_0123456789abcdef01234568")
    call = {"id": "call_x", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = MINISTRAL.history([{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "call_x", "content": "22"}])
    assert history[0]["tool_calls"][0]["id"] == history[1]["tool_call_id"] == template_call_id(
        "call_x")
    assert call["id"] == "call_x"  # the caller's messages are not changed


def test_a_tekken_vocabulary_speaks_mistral() -> None:
    assert isinstance(dialect_for(TokenizerFacts(vocab=VOCAB)), Mistral)
    assert MINISTRAL.reasoning_close == "[/THINK]" and SMALL_3_2.reasoning_close is None


def test_the_forced_call_is_written_as_the_template_writes_it() -> None:
    with_id = SMALL_3_2.forced_calls(TOOLS, "required", True, json.dumps)
    assert with_id.startswith("calls: call+\n")
    assert ('call_0: "[TOOL_CALLS]" "get_weather" "[CALL_ID]" /[A-Za-z0-9]{9}/ "[ARGS]" '
            'args_0') in with_id
    without = MINISTRAL.forced_calls(TOOLS, "get_weather", False, json.dumps)
    assert without.startswith("calls: call\n")
    assert 'call_0: "[TOOL_CALLS]" "get_weather" "[ARGS]" args_0' in without


def test_the_splitter_reads_the_header_whole() -> None:
    splitter = MarkedCallSplitter(SYNTAX, None)
    pieces = splitter.feed("[TOOL_CALLS]get_weather[CALL")
    assert all(text == "" for _, text in pieces)
    pieces = splitter.feed('_ID]abc123def[ARGS]{"a"')
    assert "".join(text for _, text in pieces) == '{"name": "get_weather", "arguments": {"a"'
