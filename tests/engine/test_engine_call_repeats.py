"""A row that repeats a tool call ends there; answers with calls finish as tool_calls.

Greedy small models given a forced ``tool_choice`` with parallel calls allowed write the
same call again and again until ``max_tokens``. The tiny model is made to do exactly that
with a logits processor that pushes a fixed token sequence (the grammar still decides what
is allowed), so the test does not depend on what its random weights prefer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine import ChatRequest, Engine, FinishReason, LarkGrammar
from tests.conftest import greedy
from tests.engine.test_engine_tools import ASK, CLOCK


def call_text(tz: str) -> str:
    body = json.dumps({"name": "get_time", "arguments": {"tz": tz}})
    return f"<tool_call>\n{body}\n</tool_call>"


def pushing(sequence: Sequence[int]) -> Any:
    """A logits processor that makes token ``sequence[i]`` the likeliest for generated
    token ``i`` (cycling); tokens the row's grammar forbids stay forbidden.

    The position comes from the context's length, not from counting calls: tokens a
    grammar forces are fed without a processor call (fast-forward)."""
    start: list[int] = []

    def process(tokens: Any, logits: mx.array) -> mx.array:
        if not start:
            start.append(len(tokens))  # the first call sees the prompt
        target = sequence[(len(tokens) - start[0]) % len(sequence)]
        return mx.where(mx.arange(logits.shape[-1]) == target, logits + 1e4, logits)

    return process


def ids(eng: Engine, text: str) -> list[int]:
    return list(eng.tokenizer.encode(text, add_special_tokens=False))


def test_a_forced_row_repeating_its_call_ends_after_the_first(tiny_engine: Engine) -> None:
    call, newline = ids(tiny_engine, call_text("UTC")), ids(tiny_engine, "\n")
    for choice in ("required", "get_time"):
        params = greedy(400, logits_processors=(pushing(call + newline),))
        events = list(tiny_engine.submit(ChatRequest.from_openai(ASK, params, tools=[CLOCK],
                                                                 tool_choice=choice)))
        result = events[-1].completion
        assert result is not None
        assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
        assert [(c.name, c.arguments) for c in result.tool_calls] == [
            ("get_time", {"tz": "UTC"})]
        assert result.invalid_tool_calls == ()
        # It ended on the token that closed the repeat, not at max_tokens.
        assert result.text == f"{call_text('UTC')}\n{call_text('UTC')}"
        assert len(result.token_ids) == 2 * len(call) + len(newline)
        assert result.content == "" and all(e.content == "" for e in events)
    stats = tiny_engine.stats()  # a tool_calls finish is a normal completion
    assert stats.completed == 2 and stats.failed == stats.cancelled == 0


def test_distinct_forced_calls_go_on_until_the_model_stops(tiny_engine: Engine) -> None:
    first, second = ids(tiny_engine, call_text("UTC")), ids(tiny_engine, call_text("CET"))
    newline, eos = ids(tiny_engine, "\n"), [min(tiny_engine.tokenizer.eos_token_ids)]
    params = greedy(400, logits_processors=(pushing(first + newline + second + newline + eos),))
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, params, tools=[CLOCK],
                                                        tool_choice="required")).result()
    assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
    assert [c.arguments for c in result.tool_calls] == [{"tz": "UTC"}, {"tz": "CET"}]
    assert result.content == ""


def test_any_row_with_tools_stops_at_a_repeated_call(tiny_engine: Engine) -> None:
    # Not forced: an ordinary grammar writes the same call three times; the row ends at
    # the second, with the first call only.
    call = _lark(call_text("JST"))
    thrice = LarkGrammar(f'start: call "\\n" call "\\n" call\ncall: {call}\n')
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(200, constraint=thrice),
                                                        tools=[CLOCK])).result()
    assert result.finish_reason is FinishReason.TOOL_CALLS
    assert [c.arguments for c in result.tool_calls] == [{"tz": "JST"}]
    assert result.text == f"{call_text('JST')}\n{call_text('JST')}"


def test_a_plain_answer_still_finishes_as_stop(tiny_engine: Engine) -> None:
    sunny = greedy(20, constraint=LarkGrammar('start: "Sunny."'))
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, sunny, tools=[CLOCK])).result()
    assert result.finish_reason is FinishReason.STOP and result.content == "Sunny."
    stats = tiny_engine.stats()
    assert stats.failed == 0 and stats.cancelled == 0


def _lark(text: str) -> str:
    """``text`` as a Lark sequence, with the call markers as the special tokens they are."""
    body = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    return f"<tool_call> {json.dumps(body)} </tool_call>"
