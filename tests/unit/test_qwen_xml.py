"""Qwen3.5's XML tool calls read into content, reasoning and calls (no model): through
``RowChannels`` as a row reads them, fed whole and a character at a time. The texts are
what Qwen3.5's template writes for an assistant turn after its ``<think>`` prompt."""

from __future__ import annotations

import json

import pytest

from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.qwen_xml import QwenXml
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.channels import CONTENT, REASONING
from engine.requests.outbound.row_channels import RowChannels

TOOLS = normalize_tools([{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "where": {"type": "object"},
        "ratio": {"type": ["number", "null"]}},
        "required": ["city"]}}}])
DIALECT = QwenXml(TokenizerFacts(markers={REASONING: ("<think>", "</think>")}))
THINK = "The user wants Paris weather.\n</think>\n\n"
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")


def read(text: str, *, by_char: bool = False, start: str = REASONING) -> RowChannels:
    channels = RowChannels(DIALECT.splitter(start, TOOLS), DIALECT.parser, TOOLS)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


@pytest.mark.parametrize("by_char", [False, True])
def test_an_xml_call_is_a_call_and_no_markup_is_content(by_char: bool) -> None:
    channels = read(THINK + CALL, by_char=by_char)
    assert [(c.name, c.arguments) for c in channels.calls] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert channels.reasoning.strip() == "The user wants Paris weather."
    assert channels.content == "" and not channels.invalid


@pytest.mark.parametrize("by_char", [False, True])
def test_values_are_typed_by_the_tools_schema(by_char: bool) -> None:
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork <NY>\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n"
            '</parameter>\n<parameter=where>\n{"lat": 1.5}\n</parameter>\n'
            "<parameter=ratio>\nnull\n</parameter>\n</function>\n</tool_call>")
    channels = read(call, by_char=by_char, start=CONTENT)
    [parsed] = channels.calls
    assert parsed.arguments == {"city": "New\nYork <NY>", "days": 3, "metric": False,
                                "where": {"lat": 1.5}, "ratio": None}
    assert json.loads(parsed.arguments_text) == parsed.arguments


def test_parallel_blocks_are_calls_in_order() -> None:
    second = CALL.replace("Paris", "Oslo")
    channels = read(THINK + CALL + "\n" + second)
    assert [c.arguments["city"] for c in channels.calls] == ["Paris", "Oslo"]
    assert channels.content == ""


def test_a_string_value_streams_in_fragments_that_add_up() -> None:
    channels = RowChannels(DIALECT.splitter(CONTENT, TOOLS), None, TOOLS)
    deltas = []
    for ch in CALL.replace("Paris", "Paris, the capital of France"):
        channels.feed(ch)
        deltas += channels.take_deltas()
    channels.finish()
    deltas += channels.take_deltas()
    assert deltas[0].name == "get_weather"
    fragments = [d.arguments for d in deltas[1:] if d.arguments]
    assert len(fragments) > 10
    assert "".join(fragments) == '{"city": "Paris, the capital of France"}'


def test_a_value_the_schema_cannot_read_makes_the_call_invalid() -> None:
    channels = read(CALL.replace("<parameter=city>\nParis",
                                 "<parameter=days>\nthree"), start=CONTENT)
    assert not channels.calls and channels.invalid


def test_a_call_cut_before_its_function_closes_is_invalid() -> None:
    channels = read(THINK + CALL[:CALL.index("</function>")])
    assert not channels.calls
    [invalid] = channels.invalid
    assert invalid.name == "get_weather"


def test_text_around_a_call_stays_content() -> None:
    channels = read("Let me check.\n\n" + CALL, start=CONTENT)
    assert channels.content.strip() == "Let me check." and len(channels.calls) == 1


def test_the_forced_call_is_written_in_the_xml() -> None:
    lark = DIALECT.forced_calls(TOOLS, "get_weather", True, json.dumps)
    assert lark.startswith('calls: call ("\\n" call)*\ncall: call_0\n')
    assert ('call_0: "<tool_call>" "\\n<function=get_weather>\\n" p0_0 p0_1? p0_2? p0_3? '
            'p0_4? "</function>\\n" "</tool_call>"') in lark
    assert 'p0_0: "<parameter=city>\\n" /[^<\\n]+/ "\\n</parameter>\\n"' in lark
    assert 'p0_2: "<parameter=metric>\\n" ("true" | "false")' in lark
    one = DIALECT.forced_calls(TOOLS, "required", False, json.dumps)
    assert one.startswith("calls: call\n")
