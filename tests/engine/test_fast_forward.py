"""Grammar fast-forward: tokens a grammar forces advance several at once, as ordinary tokens.

Tokens are grouped by the engine step that produced them, read from ``on_token`` (it runs
on the engine thread inside the step, before the step is counted), so "several tokens in
one step" is observed, not inferred from timings.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from engine import ChatRequest, Engine, FinishReason, SamplingParams, StepProbe, TextRequest
from engine.requests.inbound.output_constraint import JsonSchema, LarkGrammar, Regex
from tests.conftest import greedy, request_for, wait_until
from tests.engine.test_engine_tools import ASK, CLOCK
from tests.unit.test_tools import WEATHER

NESTED = {"type": "object", "properties": {
    "trip": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "season": {"enum": ["spring", "summer", "autumn", "winter"]}},
        "required": ["city", "season"]},
    "travellers": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
        "minItems": 1, "maxItems": 2}},
    "required": ["trip", "travellers"]}
ENUM = {"type": "object", "properties": {
    "answer": {"enum": ["supercalifragilistic", "antidisestablishment"]}},
    "required": ["answer"]}


def per_step(eng: Engine) -> tuple[Callable[[int, str], None], Counter[int]]:
    """An on_token callback counting the tokens each engine step brought."""
    counts: Counter[int] = Counter()

    def on_token(_token: int, _delta: str) -> None:
        counts[eng.stats().steps] += 1

    return on_token, counts


def run(eng: Engine, prompt: Any, params: SamplingParams, **kw: Any) -> tuple[Any, Counter[int]]:
    on_token, counts = per_step(eng)
    result = eng.submit(request_for(prompt, params, **kw), on_token=on_token).result(timeout=120)
    return result, counts


@pytest.fixture
def engines(make_engine: Callable[..., Engine]) -> tuple[Engine, Engine]:
    """The same tiny model with fast-forward on (the default) and off."""
    return (make_engine(max_batch=16, prefill_chunk=64),
            make_engine(max_batch=16, prefill_chunk=64, fast_forward=False))


CASES: dict[str, tuple[Any, SamplingParams, dict[str, Any]]] = {
    "forced tool call": (ASK, greedy(120), {"tools": [WEATHER, CLOCK],
                                           "tool_choice": "required",
                                           "parallel_tool_calls": False}),
    "forced tool name": (ASK, greedy(120), {"tools": [WEATHER, CLOCK],
                                           "tool_choice": "get_time",
                                           "parallel_tool_calls": False}),
    "nested schema": ("plan", greedy(160, constraint=JsonSchema(NESTED)), {}),
    "enum tail": ("pick", greedy(40, constraint=JsonSchema(ENUM)), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forced_spans_advance_several_tokens_in_one_step(engines: tuple[Engine, Engine],
                                                         case: str) -> None:
    on, off = engines
    prompt, params, kw = CASES[case]
    fast, fast_steps = run(on, prompt, params, **kw)
    slow, slow_steps = run(off, prompt, params, **kw)
    # The same greedy tokens either way: forced tokens are the only ones the grammar allows.
    assert fast.token_ids == slow.token_ids
    assert fast.text == slow.text and fast.finish_reason is slow.finish_reason
    assert max(slow_steps.values()) == 1  # off: one token per step
    assert max(fast_steps.values()) >= 3, fast_steps  # on: a span in one step
    assert len(fast_steps) < len(slow_steps)
    assert fast.usage.completion_tokens == slow.usage.completion_tokens  # forced ones count
    if kw:
        assert fast.finish_reason is FinishReason.TOOL_CALLS and len(fast.tool_calls) == 1
        assert fast.tool_calls[0].name == ("get_time" if case == "forced tool name"
                                           else fast.tool_calls[0].name)
    else:
        schema = NESTED if case == "nested schema" else ENUM
        jsonschema.validate(json.loads(fast.text), schema)
    stats = on.stats()
    assert stats.forced_tokens > 0 and off.stats().forced_tokens == 0
    assert stats.live_matchers == 0


def test_enum_tail_is_forced_after_the_first_letters(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    result, counts = run(on, "pick", greedy(40, constraint=JsonSchema(ENUM)))
    assert json.loads(result.text)["answer"] in ENUM["properties"]["answer"]["enum"]
    # '{"answer": "' is forced from the start, the rest after one distinguishing token.
    assert sum(counts.values()) == result.usage.completion_tokens
    assert on.stats().forced_tokens >= len(result.token_ids) - 3


def test_batched_equals_alone_with_fast_forward(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    requests = [(ASK, greedy(120), CASES["forced tool call"][2]),
                ("plan", greedy(160, constraint=JsonSchema(NESTED)), {}),
                ("free text", greedy(30), {}),
                ("pick", greedy(40, constraint=JsonSchema(ENUM)), {}),
                (ASK, greedy(120), CASES["forced tool name"][2]),
                ("another free text", greedy(30), {})]
    alone = [on.submit(request_for(p, params, **kw)).result(timeout=120).token_ids
             for p, params, kw in requests]
    for order in (requests, requests[::-1]):
        handles = [on.submit(request_for(p, params, **kw)) for p, params, kw in order]
        got = [h.result(timeout=120).token_ids for h in handles]
        expected = alone if order is requests else alone[::-1]
        assert got == expected
    assert on.stats().peak_running >= 4


def test_forced_tokens_reach_streams_callbacks_and_usage(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    seen: list[int] = []
    request = ChatRequest.from_openai(ASK, greedy(120, logprobs=True, top_logprobs=2),
                                      tools=[CLOCK], tool_choice="required",
                                      parallel_tool_calls=False)
    handle = on.submit(request, on_token=lambda t, _d: seen.append(t) or None)
    events = list(handle)
    result = events[-1].completion
    assert result is not None and result.tool_calls[0].name == "get_time"
    streamed = [t for e in events for t in e.token_ids]
    assert tuple(streamed) == result.token_ids == tuple(
        t for t in seen if t not in (on.tokenizer.eos_token_ids or ()))
    assert "".join(e.text for e in events) == result.text
    assert result.usage.completion_tokens == len(seen)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    forced = [lp for lp in result.logprobs if lp.logprob == 0.0 and lp.top == ((lp.token_id, 0.0),)]
    assert len(forced) >= len(result.token_ids) // 2  # the envelope and keys, documented p=1


def test_max_tokens_cuts_inside_a_forced_span(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    for limit in (3, 7, 12):
        fast, _ = run(on, ASK, greedy(limit), tools=[CLOCK], tool_choice="required",
                      parallel_tool_calls=False)
        slow, _ = run(off, ASK, greedy(limit), tools=[CLOCK], tool_choice="required",
                      parallel_tool_calls=False)
        assert fast.finish_reason is FinishReason.LENGTH
        assert len(fast.token_ids) == fast.usage.completion_tokens == limit
        assert fast.token_ids == slow.token_ids
    assert on.stats().live_matchers == 0


def test_a_stop_string_inside_a_forced_span_ends_the_row(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    grammar = LarkGrammar('start: "The answer is: " /[a-z]{2,6}/ " and that is final."')
    params = greedy(40, constraint=grammar, stop=("that",))
    fast = on.submit(TextRequest("say", params)).result()
    slow = off.submit(TextRequest("say", params)).result()
    assert fast.finish_reason is FinishReason.STOP and fast.text == slow.text
    assert fast.text.endswith(" and ") and "that" not in fast.text


def test_a_callback_stopping_inside_a_span_stops_there(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    seen: list[int] = []

    def stop_at_five(token: int, _delta: str) -> bool:
        seen.append(token)
        return len(seen) < 5

    result = on.submit(TextRequest("code", greedy(30, constraint=Regex(r"ABCDEFGHIJKLMNOP[0-9]"))),
                       on_token=stop_at_five).result()
    assert result.finish_reason is FinishReason.STOP
    assert len(result.token_ids) == len(seen) == 5
    assert on.stats().live_matchers == 0


def failing_after(calls: int) -> Any:
    """A logits processor that raises on its ``calls``-th call (a row's own code failing)."""
    count = [0]

    def process(tokens: Any, logits: mx.array) -> mx.array:
        count[0] += 1
        if count[0] >= calls:
            raise RuntimeError("processor broke")
        return logits

    return process


def test_a_row_failing_after_a_span_fails_alone(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    siblings = [(ASK, CASES["forced tool call"][2]), ("free text", {})]
    reference = [on.submit(request_for(p, greedy(60), **kw)).result().token_ids for p,
                 kw in siblings]
    # The second call is the first after a span: the lane's own sampling after the forward.
    bad = on.submit(ChatRequest.from_openai(
        ASK, greedy(60, logits_processors=(failing_after(2),)), tools=[CLOCK],
        tool_choice="required", parallel_tool_calls=False))
    handles = [on.submit(request_for(p, greedy(60), **kw)) for p, kw in siblings]
    with pytest.raises(RuntimeError, match="processor broke"):
        bad.result(timeout=60)
    assert [h.result(timeout=60).token_ids for h in handles] == reference
    assert on.stats().live_matchers == 0


def test_cancelling_fast_forwarding_rows_leaves_siblings_unchanged(
        engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    siblings = [("plan", greedy(160, constraint=JsonSchema(NESTED)), {}),
                ("free text", greedy(40), {})]
    reference = [on.submit(request_for(p, params, **kw)).result().token_ids for p, params,
                 kw in siblings]
    for cancel_after in (1, 4, 9):
        started = threading.Event()
        seen = [0]

        def count(_t: int, _d: str, after: int = cancel_after, seen: list[int] = seen,
                  started: threading.Event = started) -> None:
            seen[0] += 1
            if seen[0] >= after:
                started.set()

        forced = ChatRequest.from_openai(ASK, greedy(120), tools=[WEATHER],
                                         tool_choice="required")
        victims = [on.submit(forced, on_token=count) for _ in range(2)]
        handles = [on.submit(request_for(p, params, **kw)) for p, params, kw in siblings]
        assert started.wait(60)
        for victim in victims:
            victim.cancel()
        assert [h.result(timeout=60).token_ids for h in handles] == reference
        for victim in victims:
            wait_until(lambda v=victim: v.done)
    wait_until(lambda: on.stats().running == 0)
    assert on.stats().live_matchers == 0


def test_the_serial_lane_fast_forwards_seeded_rows(make_engine: Callable[..., Engine]) -> None:
    on = make_engine(max_batch=16)
    off = make_engine(max_batch=16, fast_forward=False)
    params = SamplingParams(max_tokens=160, temperature=0.8, seed=7,
                            constraint=JsonSchema(NESTED))
    fast, fast_steps = run(on, "plan", params)
    again, _ = run(on, "plan", params)
    slow, slow_steps = run(off, "plan", params)
    for result in (fast, slow):
        jsonschema.validate(json.loads(result.text), NESTED)
    # The seed alone decides: forced tokens draw nothing, so on and off may differ.
    assert again.token_ids == fast.token_ids
    assert max(fast_steps.values()) >= 3 and max(slow_steps.values()) == 1
    assert on.stats().forced_tokens > 0


def test_a_direct_rejoin_decodes_what_a_prompt_segment_rejoin_does(
        make_engine: Callable[..., Engine]) -> None:
    """Rows leaving for spans while siblings decode, staggered so they rejoin beside them:
    the same tokens whether they rejoin directly or through a one-token prompt segment."""

    def through_segments(lanes: Any) -> None:  # on the engine thread, before any row
        lanes.batch.seam.direct_join = False

    requests = [(ASK, greedy(120), CASES["forced tool call"][2]),
                ("free text", greedy(40), {}),
                ("plan", greedy(160, constraint=JsonSchema(NESTED)), {}),
                (ASK, greedy(120), CASES["forced tool name"][2]),
                ("pick", greedy(40, constraint=JsonSchema(ENUM)), {})]

    def two_steps(eng: Engine) -> None:
        target = eng.stats().steps + 2
        wait_until(lambda: eng.stats().steps >= target, timeout=60)

    def staggered(eng: Engine) -> list[tuple[int, ...]]:
        handles = []
        for prompt, params, kw in requests:
            handles.append(eng.submit(request_for(prompt, params, **kw)))
            two_steps(eng)
        return [h.result(timeout=120).token_ids for h in handles]

    direct = staggered(make_engine(max_batch=16, prefill_chunk=64))
    assert all(direct)
    segments = make_engine(max_batch=16, prefill_chunk=64,
                           probe=StepProbe(on_lanes=through_segments))
    assert staggered(segments) == direct


def test_span_logits_are_the_full_forwards_at_the_last_positions(tiny_model_dir: Any) -> None:
    """A span forward computes the output head only at each row's last position; the
    logits there are the full forward's (the tiny model is qwen2, one of the
    architectures split into backbone and head)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.speedups.forced_spans import last_logits

    model, _ = load(str(tiny_model_dir))
    assert type(model).__module__ == "mlx_lm.models.qwen2"
    tokens = mx.array([[5, 9, 14, 3, 7], [11, 2, 8, 0, 0]])
    positions = mx.array([4, 2])
    full = model(tokens, cache=make_prompt_cache(model))[mx.arange(2), positions]
    split = last_logits(model, tokens, make_prompt_cache(model), positions)
    assert split.shape == full.shape
    assert mx.allclose(split, full, atol=1e-5).item()
    assert mx.array_equal(split.argmax(axis=-1), full.argmax(axis=-1)).item()
