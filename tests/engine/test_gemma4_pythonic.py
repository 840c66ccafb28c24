"""Gemma 4's ``call:`` blocks and LFM2's Python call lists read into content, reasoning and
calls (no model): through ``RowChannels`` as a row reads them, fed whole and a character
at a time, with mlx-lm's markers and (for Gemma 4) its parser, as the real tokenizers
infer them; and the forced-call Lark each writes."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import gemma4 as gemma4_parser
from mlx_lm.tool_parsers import pythonic as pythonic_parser

from engine.requests.constraints.forced_calls import separated
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.gemma4 import Gemma4
from engine.requests.dialects.pythonic import Pythonic, python_calls
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.messages import messages_from_openai, template_messages
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL
from engine.requests.outbound.row_channels import RowChannels

TOOLS = normalize_tools([{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]}}}])
GEMMA = Gemma4(TokenizerFacts(
    markers={TOOL: ("<|tool_call>", "<tool_call|>"), REASONING: ("<|channel>thought",
                                                                 "<channel|>")},
    tool_parser=gemma4_parser.parse_tool_call))
LFM2 = Pythonic(TokenizerFacts(markers={TOOL: ("<|tool_call_start|>", "<|tool_call_end|>")}))


def read(dialect: Gemma4 | Pythonic, text: str, by_char: bool) -> RowChannels:
    channels = RowChannels(dialect.splitter(CONTENT, TOOLS), dialect.parser, TOOLS)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


def test_the_parser_names_pick_the_dialects() -> None:
    assert isinstance(dialect_for(GEMMA.facts), Gemma4)
    pythonic = TokenizerFacts(tool_parser=pythonic_parser.parse_tool_call)
    assert isinstance(dialect_for(pythonic), Pythonic)
    # Our own reader of Python calls is not mlx-lm's parser: it names no family.
    assert type(dialect_for(TokenizerFacts(tool_parser=python_calls))) is not Pythonic


@pytest.mark.parametrize("by_char", [False, True])
def test_gemma4_thought_is_reasoning_and_calls_are_calls(by_char: bool) -> None:
    text = ('<|channel>thought\nParis, then.<channel|>'
            '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|>Oslo, {north}<|"|>}<tool_call|>')
    channels = read(GEMMA, text, by_char)
    assert channels.reasoning.strip() == "Paris, then."
    assert [c.arguments for c in channels.calls] == [{"city": "Paris", "days": 3},
                                                     {"city": "Oslo, {north}"}]
    assert channels.content == "" and not channels.invalid


@pytest.mark.parametrize("by_char", [False, True])
def test_lfm2_blocks_of_python_calls_are_calls(by_char: bool) -> None:
    text = ('Checking.<|tool_call_start|>[get_weather(city="Paris", days=3), '
            'get_weather(city=\'Oslo\', where={"lat": 59.9}, days=null)]<|tool_call_end|>')
    channels = read(LFM2, text, by_char)
    assert [c.arguments for c in channels.calls] == [
        {"city": "Paris", "days": 3}, {"city": "Oslo", "where": {"lat": 59.9}, "days": None}]
    assert channels.content == "Checking." and not channels.invalid


@pytest.mark.parametrize("text", ["[get_weather(city=Paris)]", "[get_weather('Paris')]",
                                  "[get_weather(city="])
def test_lfm2_text_that_is_not_a_python_call_is_invalid(text: str) -> None:
    channels = read(LFM2, f"<|tool_call_start|>{text}<|tool_call_end|>", False)
    assert not channels.calls and len(channels.invalid) == 1


def test_lfm2_a_block_cut_by_the_end_of_the_row_is_invalid() -> None:
    channels = read(LFM2, '<|tool_call_start|>[get_weather(city="Par', False)
    assert not channels.calls and len(channels.invalid) == 1


def test_separated_entries_place_commas_only_between_those_written() -> None:
    assert separated([("a", True), ("b", False)], '","') == 'a ("," b)?'
    assert separated([("a", False), ("b", True)], '","') == '(a "," b | b)'
    assert separated([("a", False), ("b", False)], '","') == '(a ("," b)? | (b)?)'
    assert separated([], '","') == '""'


def test_gemma4_forced_calls_write_its_literal_syntax() -> None:
    lark = GEMMA.forced_calls(TOOLS, "required", True, json.dumps)
    assert lark.startswith("calls: call+\ncall: call_0\n")
    # Keys sorted as the template's dictsort writes them; strings between quote tokens.
    assert ('call_0: "<|tool_call>" "call:get_weather" "{" "city:" v_0 ("," "days:" v_1)? '
            '("," "where:" v_3)? "}" "<tool_call|>"') in lark
    assert 'v_0: "<|\\"|>" /[^<]+/? "<|\\"|>"' in lark
    assert GEMMA.forced_calls(TOOLS, "get_weather", False, json.dumps).startswith(
        "calls: call\n")


def test_lfm2_forced_calls_write_a_python_call_list() -> None:
    lark = LFM2.forced_calls(TOOLS, "required", True, json.dumps)
    assert lark.startswith('calls: "<|tool_call_start|>" "[" call (", " call)* "]" '
                           '"<|tool_call_end|>"\n')
    assert 'call_0: "get_weather(" "city=" %json {"type": "string"' in lark


def test_lfm2_past_calls_are_written_into_their_turn_when_the_template_renders_none() -> None:
    chat = template_messages(messages_from_openai([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"}]))
    rewritten = LFM2.history(chat)
    assert rewritten[1]["content"] == ('<|tool_call_start|>[get_weather(city="Paris", days=3)]'
                                       "<|tool_call_end|>") and "tool_calls" not in rewritten[1]
    assert rewritten[0] == chat[0] and rewritten[2] == chat[2]
    assert python_calls(rewritten[1]["content"].split("|>", 1)[1].rsplit("<|", 1)[0]) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    renders = Pythonic(TokenizerFacts(chat_template="{{ m.tool_calls }}",
                                      markers=LFM2.facts.markers))
    assert renders.history(chat) == chat
