"""gpt-oss's harmony output read into content, reasoning and calls (no model): the splitter
alone, and through ``RowChannels`` as a row reads it, fed whole and a character at a time.

The texts are what gpt-oss writes after the prompt's ``<|start|>assistant`` (its stop
tokens ``<|call|>`` and ``<|return|>`` end a row and are never text)."""

from __future__ import annotations

import json

import pytest

from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.harmony import Harmony, HarmonySplitter
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.row_channels import RowChannels

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = normalize_tools([WEATHER])
THINK = "<|channel|>analysis<|message|>The user wants Paris weather.<|end|>"
CALL_AFTER_CHANNEL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather '
                      '<|constrain|>json<|message|>{"city": "Paris"}')
CALL_BEFORE_CHANNEL = (' to=functions.get_weather<|channel|>commentary json<|message|>'
                       '{"city": "Paris"}')
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."


def read(text: str, *, by_char: bool = False, parallel: bool = True) -> RowChannels:
    channels = RowChannels(HarmonySplitter(), None, TOOLS, parallel)
    for piece in (list(text) if by_char else [text]):
        channels.feed(piece)
    channels.finish()
    return channels


@pytest.mark.parametrize("by_char", [False, True])
def test_analysis_is_reasoning_and_final_is_content(by_char: bool) -> None:
    channels = read(THINK + ANSWER, by_char=by_char)
    assert channels.reasoning == "The user wants Paris weather."
    assert channels.content == "It is sunny in Paris."
    assert not channels.calls and not channels.invalid


@pytest.mark.parametrize("call", [CALL_AFTER_CHANNEL, CALL_BEFORE_CHANNEL])
@pytest.mark.parametrize("by_char", [False, True])
def test_a_message_to_a_function_is_a_call_and_no_markup_is_content(call: str,
                                                                    by_char: bool) -> None:
    channels = read(THINK + call, by_char=by_char)
    assert [(c.name, c.arguments) for c in channels.calls] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert channels.calls[0].arguments_text == '{"city": "Paris"}'  # the model's own text
    assert channels.content == "" and channels.reasoning == "The user wants Paris weather."


def test_a_call_on_the_analysis_channel_is_a_call() -> None:
    channels = read('<|channel|>analysis to=functions.get_weather <|constrain|>json'
                    '<|message|>{"city": "Oslo"}')
    assert [c.arguments for c in channels.calls] == [{"city": "Oslo"}]
    assert channels.reasoning == "" and channels.content == ""


def test_the_arguments_stream_in_fragments_that_add_up() -> None:
    channels = RowChannels(HarmonySplitter(), None, TOOLS)
    deltas = []
    for ch in THINK + CALL_AFTER_CHANNEL:
        channels.feed(ch)
        deltas += channels.take_deltas()
    channels.finish()
    deltas += channels.take_deltas()
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris"}'


def test_a_preamble_on_commentary_is_content() -> None:
    channels = read("<|channel|>commentary<|message|>Let me check.<|end|>"
                    + CALL_AFTER_CHANNEL)
    assert channels.content == "Let me check." and len(channels.calls) == 1


def test_a_call_cut_inside_its_arguments_is_invalid() -> None:
    channels = read(THINK + CALL_AFTER_CHANNEL[:-4])
    assert not channels.calls
    [invalid] = channels.invalid
    assert invalid.name == "get_weather"


def test_the_splitter_holds_a_marker_split_across_feeds() -> None:
    splitter = HarmonySplitter()
    pieces = splitter.feed("<|channel|>final<|message|>Hi<|e")
    assert ("content", "Hi") in pieces and all("<|" not in text for _, text in pieces)
    pieces = splitter.feed("nd|><|start|>assistant<|chan")
    assert all(text == "" for _, text in pieces)
    assert splitter.flush() == []


def test_a_harmony_vocabulary_speaks_harmony() -> None:
    vocab = {token: i for i, token in enumerate(
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"])}
    assert isinstance(dialect_for(TokenizerFacts(vocab=vocab)), Harmony)
    assert not isinstance(dialect_for(TokenizerFacts(vocab={"<think>": 1})), Harmony)


def test_the_forced_call_is_written_as_gpt_oss_writes_it() -> None:
    lark = Harmony(TokenizerFacts()).forced_calls(TOOLS, "required", True, json.dumps)
    assert lark.startswith("calls: call\ncall: call_0\n")  # one call, parallel or not
    assert '"<|channel|>" "commentary to=functions." "get_weather" " " "<|constrain|>" ' \
           '"json" "<|message|>" args_0 "<|call|>"' in lark
    assert '"additionalProperties": false' in lark
