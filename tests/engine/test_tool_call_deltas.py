"""Tool calls stream as ``StreamEvent.tool_call_deltas``: a call's name once it is written,
then its arguments in fragments as the model writes them.

A call the engine may still drop (a repeat, an extra call with parallel calls off) is held
back and never sent if it is dropped; the deltas of a stream add up to exactly
``completion.tool_calls``, except a call cut by the row's end, which was sent as far as it
was written and is invalid under its index (OpenAI's semantics). Grammar-forced spans
arrive in one step (fast-forward); the token-by-token tests push tokens with a logits
processor instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine import ChatRequest, Engine, FinishReason, LarkGrammar, StreamEvent, ToolCallDelta
from tests.conftest import greedy
from tests.engine.test_engine_call_repeats import _lark, call_text, ids, pushing
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


def test_each_call_streams_as_it_is_written_and_adds_up_to_the_result(
        tiny_engine: Engine) -> None:
    grammar = LarkGrammar(f'start: {_lark(call_text("UTC"))} "\\n" '
                          f'{_lark(call_text("CET"))} "\\nDone."\n')
    events = list(tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(200, constraint=grammar),
                                                             tools=[CLOCK])))
    result = events[-1].completion
    assert result is not None and [c.arguments for c in result.tool_calls] == [
        {"tz": "UTC"}, {"tz": "CET"}]
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]
    # The first call is out, whole, the step its object closed, before the second one is
    # written; the second streams before the row ends.
    first_done = max(i for i, e in enumerate(events)
                     if any(d.index == 0 for d in e.tool_call_deltas))
    second = first_event(events, 1)
    assert first_done < second < len(events) - 1
    assert "".join(e.text for e in events[:first_done + 1]).endswith('"UTC"}')


def test_a_repeated_call_never_streams(tiny_engine: Engine) -> None:
    call = _lark(call_text("JST"))
    thrice = LarkGrammar(f'start: call "\\n" call "\\n" call\ncall: {call}\n')
    events = list(tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(200, constraint=thrice),
                                                             tools=[CLOCK])))
    result = events[-1].completion
    assert result is not None and len(result.tool_calls) == 1
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]


def test_malformed_and_nameless_cut_calls_never_stream(tiny_engine: Engine) -> None:
    broken = LarkGrammar('start: "Sure. " <tool_call> "\\n{\\"name\\": oops\\n" </tool_call>')
    events = list(tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(40, constraint=broken),
                                                             tools=[CLOCK])))
    assert events[-1].completion is not None
    assert len(events[-1].completion.invalid_tool_calls) == 1
    assert deltas_of(events) == []
    # Cut by max_tokens (in one forced span) before its name was read: never streamed.
    one = LarkGrammar(f"start: {_lark(call_text('UTC'))}\n")
    cut = list(tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(8, constraint=one),
                                                          tools=[CLOCK])))
    result = cut[-1].completion
    assert result is not None and result.tool_calls == () and result.invalid_tool_calls
    assert deltas_of(cut) == []


def test_with_parallel_calls_off_only_the_first_call_is_kept_or_streamed(
        tiny_engine: Engine) -> None:
    # Not forced (auto): the model writes two calls anyway; the second is dropped.
    grammar = LarkGrammar(f'start: {_lark(call_text("UTC"))} "\\n" '
                          f'{_lark(call_text("CET"))} "\\n"\n')
    request = ChatRequest.from_openai(ASK, greedy(200, constraint=grammar), tools=[CLOCK],
                                      parallel_tool_calls=False)
    events = list(tiny_engine.submit(request))
    result = events[-1].completion
    assert result is not None and [c.arguments for c in result.tool_calls] == [{"tz": "UTC"}]
    assert result.invalid_tool_calls == ()
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]


def pushed(eng: Engine, text: str, max_tokens: int = 400) -> list[StreamEvent]:
    """The events of a row whose model writes ``text`` token by token, then stops."""
    sequence = [*ids(eng, text), min(eng.tokenizer.eos_token_ids)]
    params = greedy(max_tokens, logits_processors=(pushing(sequence),))
    return list(eng.submit(ChatRequest.from_openai(ASK, params, tools=[CLOCK])))


def first_event(events: Sequence[StreamEvent], index: int) -> int:
    return next(i for i, e in enumerate(events)
                if any(d.index == index for d in e.tool_call_deltas))


def test_a_call_streams_its_name_then_its_arguments_as_they_are_written(
        tiny_engine: Engine) -> None:
    events = pushed(tiny_engine, call_text("Europe/Paris") + "\n")
    result = events[-1].completion
    assert result is not None and result.finish_reason is FinishReason.TOOL_CALLS
    (call,) = result.tool_calls
    deltas = deltas_of(events)
    assert (deltas[0].index, deltas[0].id, deltas[0].name, deltas[0].arguments) == (
        0, call.id, "get_time", "")
    assert len(deltas) > 3 and all(d.name is None and d.arguments for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == call.arguments_text == '{"tz": "Europe/Paris"}'
    # The name went out before its arguments were written; each fragment the step its
    # text was generated, before the call's object closed.
    at = first_event(events, 0)
    assert '"arguments"' not in "".join(e.text for e in events[:at + 1])
    last = max(i for i, e in enumerate(events) if e.tool_call_deltas)
    assert "".join(e.text for e in events[:last + 1]).endswith('"Europe/Paris"}')


def test_a_repeat_is_held_and_never_sent_a_near_repeat_flushes_where_it_diverges(
        tiny_engine: Engine) -> None:
    events = pushed(tiny_engine, f"{call_text('Europe/Paris')}\n{call_text('Europe/Paris')}\n")
    result = events[-1].completion
    assert result is not None and len(result.tool_calls) == 1
    assert {d.index for d in deltas_of(events)} == {0}
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]
    events = pushed(tiny_engine, f"{call_text('Europe/Paris')}\n{call_text('Europe/Berlin')}\n")
    result = events[-1].completion
    assert result is not None and [c.arguments["tz"] for c in result.tool_calls] == [
        "Europe/Paris", "Europe/Berlin"]
    assert joined(deltas_of(events)) == [(c.id, c.name, c.arguments_text)
                                         for c in result.tool_calls]
    at = first_event(events, 1)  # held while it read as a repeat of the first call
    before = "".join(e.text for e in events[:at]).split("</tool_call>", 1)[1]
    upto = "".join(e.text for e in events[:at + 1]).split("</tool_call>", 1)[1]
    assert "Europe/B" not in before and "Europe/B" in upto  # sent the step it diverged
    flushed = [d for d in events[at].tool_call_deltas if d.index == 1]
    assert flushed[0].name == "get_time" and "".join(d.arguments for d in flushed).startswith(
        '{"tz": "Europe/B')


def test_a_cut_call_was_sent_as_far_as_written_and_is_invalid(tiny_engine: Engine) -> None:
    text = call_text("Europe/Paris")
    tokens = ids(tiny_engine, text)
    k = next(k for k in range(len(tokens))
             if '"tz": "Eu' in tiny_engine.tokenizer.decode(tokens[:k]))
    events = pushed(tiny_engine, text, max_tokens=k)
    result = events[-1].completion
    assert result is not None and result.finish_reason is FinishReason.LENGTH
    assert result.tool_calls == ()
    (cut,) = result.invalid_tool_calls
    ((cid, _, arguments),) = joined(deltas_of(events))
    assert (cut.id, cut.name, cut.index) == (cid, "get_time", 0)
    assert arguments and '{"tz": "Europe/Paris"}'.startswith(arguments)
    assert cut.raw.endswith(arguments)  # what was generated, the arguments last
