"""Tool calls stream as ``StreamEvent.tool_call_deltas``: each call the step it is kept.

A call is released once its closing marker arrived, it parsed and it repeats no earlier
call; a call the engine drops (a repeat, a malformed or cut call) never appears, and the
deltas of a stream add up to exactly ``completion.tool_calls``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine import Engine, LarkGrammar, StreamEvent, ToolCallDelta
from tests.conftest import greedy
from tests.engine.test_engine_call_repeats import _lark, call_text
from tests.engine.test_engine_tools import ASK, CLOCK


def joined(deltas: Sequence[ToolCallDelta]) -> list[tuple[str | None, str | None, str]]:
    """(id, name, arguments text) per call index, the way a client accumulates deltas."""
    calls: dict[int, list[str | None]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, [None, None, ""])
        call[0] = call[0] or d.id
        call[1] = call[1] or d.name
        call[2] = (call[2] or "") + d.arguments
    return [(c[0], c[1], c[2] or "") for _, c in sorted(calls.items())]


def deltas_of(events: Sequence[StreamEvent]) -> list[ToolCallDelta]:
    return [d for e in events for d in e.tool_call_deltas]


def test_each_call_streams_the_step_it_closes_and_adds_up_to_the_result(
        tiny_engine: Engine) -> None:
    grammar = LarkGrammar(f'start: {_lark(call_text("UTC"))} "\\n" '
                          f'{_lark(call_text("CET"))} "\\nDone."\n')
    events = list(tiny_engine.submit(ASK, greedy(200, constraint=grammar), tools=[CLOCK]))
    result = events[-1].completion
    assert result is not None and [c.arguments for c in result.tool_calls] == [
        {"tz": "UTC"}, {"tz": "CET"}]
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]
    # The first call is out before the second one is written, both before the row ends.
    at = [i for i, e in enumerate(events) if e.tool_call_deltas]
    assert len(at) == 2 and at[0] < at[1] < len(events) - 1
    text_before_second = "".join(e.text for e in events[:at[1] + 1])
    assert text_before_second.endswith(call_text("CET"))


def test_a_repeated_call_never_streams(tiny_engine: Engine) -> None:
    call = _lark(call_text("JST"))
    thrice = LarkGrammar(f'start: call "\\n" call "\\n" call\ncall: {call}\n')
    events = list(tiny_engine.submit(ASK, greedy(200, constraint=thrice), tools=[CLOCK]))
    result = events[-1].completion
    assert result is not None and len(result.tool_calls) == 1
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]


def test_malformed_and_cut_calls_never_stream(tiny_engine: Engine) -> None:
    broken = LarkGrammar('start: "Sure. " <tool_call> "\\n{\\"name\\": oops\\n" </tool_call>')
    events = list(tiny_engine.submit(ASK, greedy(40, constraint=broken), tools=[CLOCK]))
    assert events[-1].completion is not None
    assert len(events[-1].completion.invalid_tool_calls) == 1
    assert deltas_of(events) == []
    # Cut by max_tokens inside its arguments: reported invalid, never streamed.
    one = LarkGrammar(f"start: {_lark(call_text('UTC'))}\n")
    cut = list(tiny_engine.submit(ASK, greedy(8, constraint=one), tools=[CLOCK]))
    result = cut[-1].completion
    assert result is not None and result.tool_calls == () and result.invalid_tool_calls
    assert deltas_of(cut) == []


def test_with_parallel_calls_off_only_the_first_call_is_kept_or_streamed(
        tiny_engine: Engine) -> None:
    # Not forced (auto): the model writes two calls anyway; the second is dropped.
    grammar = LarkGrammar(f'start: {_lark(call_text("UTC"))} "\\n" '
                          f'{_lark(call_text("CET"))} "\\n"\n')
    events = list(tiny_engine.submit(ASK, greedy(200, constraint=grammar), tools=[CLOCK],
                                     parallel_tool_calls=False))
    result = events[-1].completion
    assert result is not None and [c.arguments for c in result.tool_calls] == [{"tz": "UTC"}]
    assert result.invalid_tool_calls == ()
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]
