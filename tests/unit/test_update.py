"""engine.core.update: how a row ends, from hand-built rows and lane steps (no mlx, no model).

The precedence under test is the one engine/core/update.py documents: the row's own failure ->
error; a stop token -> stop; a stop string -> stop; ``max_tokens`` -> length; grammar
complete -> stop; a tool call repeating an earlier one -> stop (the repeat dropped);
``on_token`` returned False -> stop, or raised -> error; a stop with calls -> tool_calls.
"""

from __future__ import annotations

import pytest

from engine.core.lane import LaneStep, RowToken
from engine.core.rows import RequestStatus, Row
from engine.core.streams import RequestStream
from engine.core.update import Ending, StepOutcome, take_token, update
from engine.requests.inbound.sampling import SamplingParams, TokenCallback
from engine.requests.inbound.text_request import TextRequest
from engine.requests.outbound.channels import ChannelSplitter
from engine.requests.outbound.results import Completion, FinishReason, StreamEvent, TokenLogprob
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText
from engine.requests.prepare import PreparedRequest

EOS = 0
VOCAB = {
    EOS: "<|eos|>",  # would be text if it ever reached the detokenizer
    1: "Hel",
    2: "lo",
    3: " wor",
    4: "ld",
    5: " ST",
    6: "OP",
    7: "lo STOP and more",
    8: "<think>",
    9: "hmm",
    10: "</think>",
    11: "<tool_call>",
    12: '{"name": "f", "arguments": {"x": 1, "y": [1, 2]}}',
    13: "</tool_call>",
    14: "\n",
    15: '{"name": "f", "arguments": {"x": 2, "y": [1, 2]}}',
    16: '{"arguments": {"y": [1, 2], "x": 1}, "name": "f"}',  # 12 with its keys reordered
    17: "Done",
    18: '{"name": "g", "arguments": {"x": 1, "y": [1, 2]}}',
}
OPEN, CALL, CLOSE, NL, OTHER, REORDERED, DONE, OTHER_TOOL = range(11, 19)


class FakeDetokenizer:
    """Maps each token id to a fixed piece of text (a ``StreamingDetokenizer`` of
    engine.requests.outbound.text)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self._pending = ""

    def add_token(self, token: int) -> None:
        self.seen.append(token)
        self._pending += VOCAB[token]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        out, self._pending = self._pending, ""
        return out


def make_row(request_id: int = 1, *, max_tokens: int = 10, stop: tuple[str, ...] = (),
             on_token: TokenCallback | None = None,
             stop_ids: frozenset[int] = frozenset({EOS}), logprobs: bool = False) -> Row:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, logprobs=logprobs)
    row = Row(request_id, TextRequest("hi", params), RequestStream(), on_token,
              submitted_at=0.0, deadline=None, status=RequestStatus.PREFILLING)
    row.prepared = PreparedRequest([100, 101, 102], params, stop_ids)
    row.text = RowText(FakeDetokenizer(), params.stop)
    row.channels = RowChannels(ChannelSplitter({"reasoning": ("<think>", "</think>"),
                                                "tool": ("<tool_call>", "</tool_call>")}),
                               None, ())
    return row


def detokenizer(row: Row) -> FakeDetokenizer:
    assert row.text is not None
    fake = row.text._detokenizer
    assert isinstance(fake, FakeDetokenizer)
    return fake


def step(*tokens: RowToken | tuple[int, int], failed: dict[int, BaseException] | None = None,
         cached: dict[int, int] | None = None) -> LaneStep:
    made = [t if isinstance(t, RowToken) else RowToken(*t) for t in tokens]
    return LaneStep(made, failed or {}, cached or {}, width=len(made))


def feed(row: Row, *tokens: int, now: float = 1.0) -> list[StepOutcome]:
    """One lane step per token for a single row."""
    return [update({row.request_id: row}, step((row.request_id, t)), now + i)
            for i, t in enumerate(tokens)]


def only_ending(outcome: StepOutcome) -> Ending:
    assert not outcome.events, outcome.events
    assert len(outcome.endings) == 1, outcome.endings
    return outcome.endings[0]


# ----- tokens that do not end the row --------------------------------------------------


def test_non_final_tokens_become_events_with_the_text_delta() -> None:
    row = make_row()
    first, second = feed(row, 1, 2)
    assert first.events == [(row, StreamEvent("Hel", (1,), None, content="Hel"))]
    assert second.events == [(row, StreamEvent("lo", (2,), None, content="lo"))]
    assert not first.endings and not second.endings
    assert first.tokens == second.tokens == 1
    assert row.token_ids == [1, 2] and row.completion_tokens == 2
    assert row.text is not None and row.text.text == "Hello"


def test_event_deltas_are_split_into_content_and_reasoning() -> None:
    row = make_row()
    outcomes = feed(row, 8, 9, 10, 1)
    events = [event for outcome in outcomes for _, event in outcome.events]
    assert [e.text for e in events] == ["<think>", "hmm", "</think>", "Hel"]
    assert [e.reasoning for e in events] == ["", "hmm", "", ""]
    assert [e.content for e in events] == ["", "", "", "Hel"]


def test_status_becomes_decoding_on_the_first_token() -> None:
    row = make_row()
    assert row.status is RequestStatus.PREFILLING
    update({1: row}, step((1, 1)), now=5.0)
    assert row.status is RequestStatus.DECODING
    assert row.first_token_at == row.last_token_at == 5.0
    update({1: row}, step((1, 2)), now=7.0)
    assert row.first_token_at == 5.0 and row.last_token_at == 7.0


def test_logprobs_ride_on_the_event_and_are_kept_on_the_row() -> None:
    row = make_row()
    logprob = TokenLogprob(1, -0.25, ((1, -0.25), (2, -1.5)))
    outcome = update({1: row}, step(RowToken(1, 1, logprob)), now=1.0)
    assert outcome.events[0][1].logprobs == (logprob,)
    assert row.logprobs == [logprob]


def test_a_stop_tokens_logprob_is_in_neither_the_last_event_nor_the_completion() -> None:
    # The stop token is no output: a stream's logprobs must add up to the completion's.
    row = make_row(logprobs=True)
    first = TokenLogprob(1, -0.25)
    update({1: row}, step(RowToken(1, 1, first)), now=1.0)
    ending = only_ending(update({1: row}, step(RowToken(1, EOS, TokenLogprob(EOS, -0.5))),
                                now=2.0))
    assert ending.reason is FinishReason.STOP and ending.logprobs == ()
    event, completion = finished(row, ending)
    assert event.logprobs == () and completion.logprobs == (first,)


def test_take_token_returns_the_event_for_a_plain_token() -> None:
    row = make_row()
    out = take_token(row, RowToken(1, 3), now=2.0)
    assert out == StreamEvent(" wor", (3,), None, content=" wor")


# ----- each way a row ends ----------------------------------------------------------------


def test_own_failure_ends_with_error_and_its_token_is_dropped() -> None:
    row, sibling = make_row(1), make_row(2)
    boom = RuntimeError("logits processor failed")
    outcome = update({1: row, 2: sibling}, step((1, 1), (2, 1), failed={1: boom}), now=1.0)
    assert len(outcome.endings) == 1
    ending = outcome.endings[0]
    assert ending.row is row and ending.reason is FinishReason.ERROR and ending.error is boom
    # The failed row gets no token event; its sibling's token is unaffected.
    assert [(r.request_id, e.text) for r, e in outcome.events] == [(2, "Hel")]
    assert outcome.tokens == 1
    assert row.token_ids == [] and row.completion_tokens == 0
    assert detokenizer(row).seen == []


def test_stop_token_ends_with_stop_and_never_becomes_text() -> None:
    row = make_row()
    *_, last = feed(row, 1, EOS)
    ending = only_ending(last)
    assert ending.reason is FinishReason.STOP and ending.error is None
    assert ending.delta == "" and ending.token_ids == ()
    assert EOS not in row.token_ids and row.token_ids == [1]
    assert EOS not in detokenizer(row).seen
    assert row.text is not None and row.text.text == "Hel"


def test_stop_token_ids_from_the_request_count_like_eos() -> None:
    row = make_row(stop_ids=frozenset({EOS, 4}))
    ending = only_ending(feed(row, 3, 4)[-1])
    assert ending.reason is FinishReason.STOP and ending.token_ids == ()
    assert row.token_ids == [3]


def test_stop_string_in_one_token_ends_with_stop_and_the_text_before_it() -> None:
    row = make_row(stop=("STOP",))
    first, last = feed(row, 1, 7)
    assert first.events[0][1].text == "Hel"
    ending = only_ending(last)
    assert ending.reason is FinishReason.STOP
    assert ending.delta == "lo " and ending.token_ids == (7,)
    assert row.text is not None and row.text.stopped and row.text.text == "Hello "


def test_stop_string_split_across_tokens_ends_with_stop() -> None:
    row = make_row(stop=("STOP",))
    outcomes = feed(row, 1, 5, 6)
    assert [e.text for o in outcomes for _, e in o.events] == ["Hel", " "]  # "ST" held back
    ending = only_ending(outcomes[-1])
    assert ending.reason is FinishReason.STOP and ending.delta == ""
    assert row.text is not None and row.text.text == "Hel "


def test_max_tokens_ends_with_length() -> None:
    row = make_row(max_tokens=2)
    first, last = feed(row, 1, 2)
    assert first.events and not first.endings
    ending = only_ending(last)
    assert ending.reason is FinishReason.LENGTH
    assert ending.delta == "lo" and ending.token_ids == (2,)


def test_stop_token_at_max_tokens_is_stop_not_length() -> None:
    row = make_row(max_tokens=2)
    ending = only_ending(feed(row, 1, EOS)[-1])
    assert ending.reason is FinishReason.STOP and ending.token_ids == ()


def test_stop_string_at_max_tokens_is_stop_not_length() -> None:
    row = make_row(max_tokens=2, stop=("STOP",))
    ending = only_ending(feed(row, 1, 7)[-1])
    assert ending.reason is FinishReason.STOP and ending.delta == "lo "


def test_grammar_done_ends_with_stop() -> None:
    row = make_row()
    outcome = update({1: row}, step(RowToken(1, 1, grammar_done=True)), now=1.0)
    ending = only_ending(outcome)
    assert ending.reason is FinishReason.STOP
    assert ending.delta == "Hel" and ending.token_ids == (1,)


def test_length_beats_grammar_done_at_the_same_token() -> None:
    row = make_row(max_tokens=1)
    outcome = update({1: row}, step(RowToken(1, 1, grammar_done=True)), now=1.0)
    assert only_ending(outcome).reason is FinishReason.LENGTH


def test_on_token_returning_false_ends_with_stop() -> None:
    calls: list[tuple[int, str]] = []

    def on_token(token: int, delta: str) -> bool:
        calls.append((token, delta))
        return len(calls) < 2

    row = make_row(on_token=on_token)
    first, second = feed(row, 1, 2)
    assert first.events and not first.endings
    ending = only_ending(second)
    assert ending.reason is FinishReason.STOP and ending.error is None
    assert ending.delta == "lo" and ending.token_ids == (2,)
    assert calls == [(1, "Hel"), (2, "lo")]


def test_on_token_returning_false_does_not_override_length() -> None:
    row = make_row(max_tokens=1, on_token=lambda token, delta: False)
    assert only_ending(feed(row, 1)[0]).reason is FinishReason.LENGTH


def test_on_token_returning_none_keeps_the_row_going() -> None:
    row = make_row(on_token=lambda token, delta: None)
    outcome = feed(row, 1)[0]
    assert outcome.events and not outcome.endings


def test_on_token_raising_ends_with_error_carrying_that_exception() -> None:
    boom = ValueError("consumer bug")

    def on_token(token: int, delta: str) -> bool:
        raise boom

    row = make_row(on_token=on_token)
    ending = only_ending(feed(row, 1)[0])
    assert ending.row is row
    assert ending.reason is FinishReason.ERROR and ending.error is boom


def test_on_token_sees_the_stop_token_with_no_text() -> None:
    calls: list[tuple[int, str]] = []

    def on_token(token: int, delta: str) -> None:
        calls.append((token, delta))

    row = make_row(on_token=on_token)
    ending = only_ending(feed(row, EOS)[0])
    assert ending.reason is FinishReason.STOP
    assert calls == [(EOS, "")]


# ----- what update does around the rows ---------------------------------------------------


def test_tokens_for_unknown_request_ids_are_skipped() -> None:
    row = make_row(1)
    outcome = update({1: row}, step((7, 1), (1, 2), (8, EOS)), now=1.0)
    assert [(r.request_id, e.text) for r, e in outcome.events] == [(1, "lo")]
    assert not outcome.endings and outcome.tokens == 1


def test_failures_and_cached_tokens_of_unknown_rows_are_ignored() -> None:
    row = make_row(1)
    outcome = update({1: row}, step(failed={9: RuntimeError("gone")}, cached={9: 5}), now=1.0)
    assert outcome == StepOutcome()
    assert row.cached_tokens == 0


def test_cached_tokens_reported_are_recorded_on_the_row() -> None:
    row, other = make_row(1), make_row(2)
    outcome = update({1: row, 2: other}, step(cached={1: 48}), now=1.0)
    assert row.cached_tokens == 48 and other.cached_tokens == 0
    assert outcome == StepOutcome()  # a prefill chunk: nothing to stream yet
    assert row.status is RequestStatus.PREFILLING


def test_rows_of_one_step_end_independently_and_in_order() -> None:
    rows = {1: make_row(1), 2: make_row(2, max_tokens=1), 3: make_row(3), 4: make_row(4)}
    outcome = update(rows, step((1, 1), (2, 1), (3, EOS), (4, 3),
                                failed={4: RuntimeError("x")}), now=1.0)
    assert [(r.request_id, e.text) for r, e in outcome.events] == [(1, "Hel")]
    assert [(e.row.request_id, e.reason) for e in outcome.endings] == [
        (4, FinishReason.ERROR), (2, FinishReason.LENGTH), (3, FinishReason.STOP)]
    assert outcome.tokens == 3


@pytest.mark.parametrize(("tokens", "max_tokens", "stop", "expected"), [
    ((1, 2, 3), 3, (), FinishReason.LENGTH),
    ((1, EOS), 5, (), FinishReason.STOP),
    ((1, 7), 5, ("STOP",), FinishReason.STOP),
    ((1, 7), 2, ("STOP",), FinishReason.STOP),
    ((1, 2, EOS), 3, (), FinishReason.STOP),
])
def test_the_first_ending_is_final(tokens: tuple[int, ...], max_tokens: int,
                                   stop: tuple[str, ...], expected: FinishReason) -> None:
    row = make_row(max_tokens=max_tokens, stop=stop)
    outcomes = feed(row, *tokens)
    assert all(o.events and not o.endings for o in outcomes[:-1])
    assert only_ending(outcomes[-1]).reason is expected



# ----- tool calls: a repeated call ends the row; a stop with calls is tool_calls -----------


def finished(row: Row, ending: Ending) -> tuple[StreamEvent, Completion]:
    """The row's last event and completion, as the engine loop builds them."""
    return row.final(ending.reason, ending.error, ending.delta, ending.token_ids,
                     ending.logprobs)


def streamed_content(outcomes: list[StepOutcome]) -> str:
    return "".join(event.content for o in outcomes for _, event in o.events)


def test_a_call_repeating_an_earlier_one_ends_the_row_and_is_dropped() -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, OPEN, CALL, CLOSE, NL, OPEN, CALL, CLOSE)
    ending = only_ending(outcomes[-1])  # the token that closed the repeat
    assert all(o.events and not o.endings for o in outcomes[:-1])
    assert ending.reason is FinishReason.TOOL_CALLS and ending.token_ids == (CLOSE,)
    event, completion = finished(row, ending)
    assert completion.finish_reason is FinishReason.TOOL_CALLS
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [
        ("f", {"x": 1, "y": [1, 2]})]
    assert completion.invalid_tool_calls == () and completion.content == ""
    assert streamed_content(outcomes[:6]) == "" and event.content == ""
    assert row.repeated_calls == 1


def test_repeats_are_compared_as_parsed_json() -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, OPEN, CALL, CLOSE, OPEN, REORDERED, CLOSE)
    assert only_ending(outcomes[-1]).reason is FinishReason.TOOL_CALLS


@pytest.mark.parametrize("second", [OTHER, OTHER_TOOL], ids=["other-arguments", "other-tool"])
def test_a_different_call_goes_on(second: int) -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, OPEN, CALL, CLOSE, NL, OPEN, second, CLOSE, NL, EOS)
    assert all(o.events and not o.endings for o in outcomes[:-1])
    ending = only_ending(outcomes[-1])
    assert ending.reason is FinishReason.TOOL_CALLS
    _, completion = finished(row, ending)
    assert len(completion.tool_calls) == 2 and completion.content == ""


def test_max_tokens_at_the_repeat_is_length() -> None:
    row = make_row(max_tokens=6)
    ending = only_ending(feed(row, OPEN, CALL, CLOSE, OPEN, CALL, CLOSE)[-1])
    assert ending.reason is FinishReason.LENGTH  # length keeps its precedence
    _, completion = finished(row, ending)
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.tool_calls) == 1


def test_a_stop_string_at_the_repeat_is_still_a_stop_with_calls() -> None:
    row = make_row(max_tokens=100, stop=("\n<tool_call>",))
    outcomes = feed(row, OPEN, CALL, CLOSE, NL, OPEN)
    ending = only_ending(outcomes[-1])
    assert ending.reason is FinishReason.TOOL_CALLS


def test_grammar_done_and_stop_tokens_with_calls_are_tool_calls() -> None:
    row = make_row(max_tokens=100)
    feed(row, OPEN, CALL)
    outcome = update({1: row}, step(RowToken(1, CLOSE, grammar_done=True)), now=9.0)
    assert only_ending(outcome).reason is FinishReason.TOOL_CALLS
    plain = make_row(max_tokens=100)
    assert only_ending(update({1: plain}, step(RowToken(1, 1, grammar_done=True)),
                              now=1.0)).reason is FinishReason.STOP


def test_an_invalid_call_alone_is_a_plain_stop() -> None:
    row = make_row(max_tokens=100)
    feed(row, OPEN, 1)
    ending = only_ending(feed(row, CLOSE, EOS)[-1])
    assert ending.reason is FinishReason.STOP
    _, completion = finished(row, ending)
    assert completion.tool_calls == () and len(completion.invalid_tool_calls) == 1


def test_on_token_raising_at_the_repeat_is_an_error() -> None:
    def on_token(token: int, delta: str) -> None:
        if token == CLOSE and row.repeated_calls:
            raise RuntimeError("consumer bug")

    row = make_row(max_tokens=100, on_token=on_token)
    ending = only_ending(feed(row, OPEN, CALL, CLOSE, OPEN, CALL, CLOSE)[-1])
    assert ending.reason is FinishReason.ERROR


def test_on_token_sees_the_text_of_the_repeat_before_the_row_ends() -> None:
    seen: list[str] = []
    row = make_row(max_tokens=100, on_token=lambda token, delta: seen.append(delta))
    ending = only_ending(feed(row, OPEN, CALL, CLOSE, OPEN, CALL, CLOSE)[-1])
    assert ending.reason is FinishReason.TOOL_CALLS
    assert "".join(seen) == "".join(VOCAB[t] for t in (OPEN, CALL, CLOSE) * 2)


# ----- whitespace around calls is not content -------------------------------------------------


def test_whitespace_before_between_and_after_calls_is_not_content() -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, NL, OPEN, CALL, CLOSE, NL, NL, OPEN, OTHER, CLOSE, NL, EOS)
    event, completion = finished(row, only_ending(outcomes[-1]))
    assert streamed_content(outcomes) == "" and event.content == ""
    assert completion.content == "" and len(completion.tool_calls) == 2
    assert row.text is not None and row.text.text.count("\n") == 4  # raw text keeps it all


def test_text_after_a_call_keeps_its_separator() -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, 1, 2, NL, OPEN, CALL, CLOSE, NL, DONE, NL, EOS)
    event, completion = finished(row, only_ending(outcomes[-1]))
    # Whitespace next to text is the answer's own: "Hello\n" before the call, "\nDone\n"
    # after it.
    assert completion.content == "Hello\n\nDone\n"
    assert streamed_content(outcomes) + event.content == completion.content


def test_a_plain_answer_keeps_its_leading_and_trailing_whitespace() -> None:
    row = make_row(max_tokens=100)
    outcomes = feed(row, NL, 1, NL, EOS)
    event, completion = finished(row, only_ending(outcomes[-1]))
    assert completion.content == "\nHel\n" and completion.finish_reason is FinishReason.STOP
    assert streamed_content(outcomes) + event.content == "\nHel\n"
    only_spaces = make_row(max_tokens=2)
    event, completion = finished(only_spaces, only_ending(feed(only_spaces, NL, NL)[-1]))
    assert completion.content == "\n\n" and event.content == "\n\n"


def test_text_held_for_a_stop_string_is_released_when_the_row_ends() -> None:
    row = make_row(stop=("STOP",))
    outcomes = feed(row, 1, 5, EOS)
    assert streamed_content(outcomes[:2]) == "Hel "  # "ST" could start "STOP"
    ending = only_ending(outcomes[-1])
    assert ending.reason is FinishReason.STOP and ending.delta == "ST"
    event, completion = finished(row, ending)
    assert event.text == "ST" and event.content == "ST" and completion.content == "Hel ST"
