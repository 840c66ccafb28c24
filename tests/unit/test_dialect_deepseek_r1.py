"""DeepSeek-R1's tool-call markers and ``<think>`` reasoning read into channels (no model),
fed whole and a character at a time; its forced calls."""

from __future__ import annotations

import json

import pytest

from engine.requests.dialects.deepseek_r1 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekR1,
)
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL
from engine.requests.outbound.row_channels import RowChannels
from tests.unit.test_harmony import TOOLS

VOCAB = {token: i for i, token in enumerate([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
                                             SEP, "<think>", "</think>"])}
DIALECT = DeepSeekR1(TokenizerFacts(vocab=VOCAB,
                                    markers={REASONING: ("<think>", "</think>")}))


def call(city: str) -> str:
    return (f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "{city}"}}\n```'
            f"{CALL_END}")


ANSWERED = "Hmm.</think>\n\nIt is sunny.\n\nBye."
ONE = f"{CALLS_BEGIN}{call('Paris')}{CALLS_END}"
TWO = f"{CALLS_BEGIN}{call('Paris')}\n{call('Oslo')}{CALLS_END}"


def read(text: str, *, by_char: bool = False, start: str = REASONING) -> RowChannels:
    channels = RowChannels(DIALECT.splitter(start), DIALECT.parser, TOOLS)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


@pytest.mark.parametrize("by_char", [False, True])
def test_reasoning_opened_by_the_prompt_then_a_call(by_char: bool) -> None:
    channels = read("Paris weather, then.\n</think>\n\n" + ONE, by_char=by_char)
    assert channels.reasoning == "Paris weather, then.\n"
    assert [(c.name, c.arguments) for c in channels.calls] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert channels.content == "" and not channels.invalid
    assert channels.calls[0].arguments_text == '{"city": "Paris"}'


@pytest.mark.parametrize("by_char", [False, True])
def test_two_calls_in_one_block(by_char: bool) -> None:
    channels = read("</think>" + TWO, by_char=by_char)
    assert [c.arguments["city"] for c in channels.calls] == ["Paris", "Oslo"]
    assert channels.content == ""


@pytest.mark.parametrize("by_char", [False, True])
def test_an_answer_is_content_from_its_first_word(by_char: bool) -> None:
    # The template's "\n\n" after </think> is layout: content starts with the answer, as
    # streamed and as a whole; the answer's own line breaks stay.
    channels = RowChannels(DIALECT.splitter(REASONING), DIALECT.parser, TOOLS)
    streamed = ""
    for piece in (list(ANSWERED) if by_char else [ANSWERED]):
        streamed += channels.feed(piece)[0]
    streamed += channels.finish()[0]
    assert channels.reasoning == "Hmm."
    assert channels.content == streamed == "It is sunny.\n\nBye."


def test_an_answer_without_reasoning_keeps_its_leading_line_breaks() -> None:
    channels = read("\n\nIt is sunny.", start=CONTENT)
    assert channels.content == "\n\nIt is sunny." and channels.reasoning == ""


def test_a_call_cut_inside_its_arguments_is_invalid() -> None:
    channels = read("</think>" + ONE[:ONE.index("Paris")])
    assert not channels.calls
    [invalid] = channels.invalid
    assert invalid.name == "get_weather"


def test_a_header_that_is_not_a_function_is_an_invalid_call() -> None:
    channels = read(f"</think>{CALLS_BEGIN}{CALL_BEGIN}function get_weather\n```json\n"
                    f'{{"city": "Paris"}}\n```{CALL_END}{CALLS_END}')
    assert not channels.calls and len(channels.invalid) == 1 and channels.content == ""


def test_the_deepseek_vocabulary_speaks_deepseek() -> None:
    dialect = dialect_for(TokenizerFacts(vocab=VOCAB))
    assert isinstance(dialect, DeepSeekR1) and dialect.markers[TOOL] == (CALLS_BEGIN,
                                                                          CALLS_END)
    assert DIALECT.reasoning_close == "</think>"


def test_a_distill_whose_markers_are_template_text_speaks_deepseek() -> None:
    # The distills keep Qwen's (or Llama's) vocabulary: no marker is a token, the published
    # template writes them as text.
    vocab = {"<think>": 0, "</think>": 1, "<tool_call>": 2}
    template = ("{{'" + CALLS_BEGIN + CALL_BEGIN + "' + tool['type'] + '" + SEP
                + "' + tool['function']['name'] + '" + CALL_END + "'}}{{'" + CALLS_END + "'}}")
    dialect = dialect_for(TokenizerFacts(chat_template=template, vocab=vocab))
    assert isinstance(dialect, DeepSeekR1)
    assert dialect_for(TokenizerFacts(chat_template="<|im_start|>", vocab=vocab)).name != (
        DeepSeekR1.name)


def test_the_forced_call_is_the_templates_calls_block() -> None:
    lark = DeepSeekR1(TokenizerFacts()).forced_calls(TOOLS, "required", True, json.dumps)
    assert lark.startswith(f'calls: {json.dumps(CALLS_BEGIN)} call ("\\n" call)* '
                           f"{json.dumps(CALLS_END)}\n")
    assert (f"call_0: {json.dumps(CALL_BEGIN)} "
            f'{json.dumps(f"function{SEP}get_weather" + chr(10) + "```json" + chr(10))} '
            f'args_0 "\\n```" {json.dumps(CALL_END)}') in lark
