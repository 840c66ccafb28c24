"""The fast-forward decision: spans taken where their measured cost is below the steps
they save, on the device's own figures (a GPU's cheap tokens, a CPU's dear ones)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import ChatRequest, Engine, TextRequest
from engine.device.span_costs import WARM_SPANS, SpanCosts, min_span
from tests.conftest import greedy
from tests.engine.test_engine_tools import ASK, CLOCK
from tests.unit.test_tools import WEATHER

MS = 1e-3


def measured(steps: dict[int, float], span_fixed: float, per_token: float,
             tokens: tuple[int, ...] = (8, 16, 24, 40)) -> SpanCosts:
    """Costs as the lane would have measured them: plain steps by width, span steps."""
    costs = SpanCosts()
    for _ in range(10):
        for width, seconds in steps.items():
            costs.stepped(width, seconds)
    width = min(steps)
    for fed in tokens:
        costs.spanned(width, fed, steps[width] + span_fixed + per_token * fed)
    return costs


def test_before_anything_is_measured_the_shipped_thresholds_decide() -> None:
    costs = SpanCosts()
    assert costs.shortest([5], 1, 1) == min_span(1) == 3
    costs.stepped(4, 50 * MS)
    assert costs.shortest([5, 9], 4, 4) == min_span(4) == 8  # no span measured yet
    assert "until their cost is measured" in costs.summary()


def test_unmeasured_costs_keep_the_shipped_thresholds_however_much_is_timed() -> None:
    """A sharded engine's ranks time their own steps: decisions made from the timings
    could differ between ranks and split their collectives, so there the thresholds
    decide for good."""
    timed = measured({1: 5 * MS, 8: 6 * MS}, span_fixed=2 * MS, per_token=0.1 * MS)
    fixed = SpanCosts(measured=False)
    for width, seconds in ((1, 5 * MS), (8, 6 * MS)):
        for _ in range(10):
            fixed.stepped(width, seconds)
    for fed in (8, 16, 24, 40):
        fixed.spanned(1, fed, 5 * MS + 2 * MS + 0.1 * MS * fed)
        fixed.checked(3 * MS)
    assert timed.shortest([10] * 8, 8, 8) == 2  # measured: taken
    assert fixed.shortest([10] * 8, 8, 8) == min_span(8)  # thresholds: alike on every rank
    assert fixed.shortest([3], 1, 1) == min_span(1)
    assert fixed.check_floor(0) is None and "ranks decide alike" in fixed.summary()


def test_a_gpu_like_device_takes_spans_only_where_the_batch_skips_steps() -> None:
    # Tokens are cheap in a forward, a step is mostly fixed cost: rows beside a decoding
    # batch save little, a batch whose every row spans skips whole steps.
    costs = measured({1: 5 * MS, 8: 6 * MS}, span_fixed=2 * MS, per_token=0.1 * MS)
    assert costs.shortest([10, 10], 8, 8) == 11  # 2 of 8 rows: declined
    assert costs.shortest([10] * 8, 8, 8) == 2  # all 8 rows: taken
    assert costs.shortest([3], 1, 1) == 2  # alone: a 3-token span saves 3 steps
    assert (costs.taken, costs.declined) == (2, 1)


def test_a_cpu_like_device_declines_spans_that_cost_what_their_steps_cost() -> None:
    # Each token costs nearly what a step costs a row: the span saves nothing beside a
    # batch, and only long spans pay for the way out and back.
    costs = measured({1: 70 * MS, 8: 360 * MS}, span_fixed=150 * MS, per_token=48 * MS)
    assert costs.shortest([4], 1, 1) == 5  # alone: 4 x 70 < 150 + 4 x 48, declined
    assert costs.shortest([20], 1, 1) == 2  # alone: 20 x 70 > 150 + 20 x 48, taken
    assert costs.shortest([12] * 8, 8, 8) == 13  # all 8: 12 x 360 < 150 + 96 x 48
    assert costs.shortest([12, 15], 8, 8) == 16  # beside 6 others: a share of 41 ms
    summary = costs.summary()
    assert "a token" in summary and "1 taken, 3 declined" in summary, summary


def test_the_measurement_follows_the_device_as_it_changes() -> None:
    costs = measured({1: 10 * MS}, span_fixed=5 * MS, per_token=1 * MS)
    assert costs.shortest([6], 1, 1) == 2
    for _ in range(200):  # the span forward got dear (a busier machine, longer rows)
        costs.spanned(1, 6, 10 * MS + 80 * MS)
    assert costs.shortest([6], 1, 1) == 7
    assert costs.version > WARM_SPANS


def test_stats_report_the_measured_costs_once_spans_ran(
        make_engine: Callable[..., Engine]) -> None:
    eng = make_engine(max_batch=4, fast_forward=True)
    before = {s.name: s for s in eng.stats().speedups}["fast_forward"]
    assert before.on and "until their cost is measured" in before.measured
    eng.submit(TextRequest("hello", greedy(24, ignore_eos=True))).result(timeout=120)
    assert "0 of" in {s.name: s for s in eng.stats().speedups}["fast_forward"].measured
    kw: dict[str, Any] = {"tools": [WEATHER, CLOCK], "tool_choice": "required",
                          "parallel_tool_calls": False}
    for i in range(WARM_SPANS + 1):  # a forced call: its envelope and arguments in spans
        prompt = ChatRequest.from_openai([{"role": "user", "content": f"{ASK} ({i})"}],
                                         greedy(120), **kw)
        eng.submit(prompt).result(timeout=120)
    assert eng.stats().forced_tokens > 0
    # Plain steps timed first (the text row), then the spans: the costs now decide.
    after = {s.name: s for s in eng.stats().speedups}["fast_forward"]
    assert after.detail == before.detail  # the /metrics label stays put
    assert after.measured != before.measured
    assert "a span" in after.measured and "a step 1 rows" in after.measured, after.measured


def test_a_speculation_check_must_bring_what_the_row_would_have_decoded_meanwhile() -> None:
    """Alone, a 25 ms check against a 10 ms step needs 1.5 accepted tokens a draft; beside
    three decoding rows (a 20 ms step of 4, 18 ms of 3) the row must bring 4.6: the others
    wait for its check. Until checks are timed, none (the fixed floor decides)."""
    from engine.device.span_costs import WARM_CHECKS
    from engine.device.speculator import Speculator

    costs = measured({1: 10 * MS, 3: 18 * MS, 4: 20 * MS}, 0.0, 1 * MS)
    speculator = Speculator(None, None, None, 1, limit=4, trims=True,  # type: ignore[arg-type]
                            costs=costs)
    assert costs.check_floor(0) is None
    assert speculator._floor(rows=1, decoding=0) == speculator.policy.acceptance_floor
    assert "fixed acceptance floor" in costs.check_summary()
    for _ in range(WARM_CHECKS):
        costs.checked(25 * MS)
    assert abs(costs.check_floor(0) - 1.5) < 1e-9  # type: ignore[operator]
    assert abs(costs.check_floor(3) - 4.6) < 1e-9  # type: ignore[operator]
    assert costs.check_floor(7) is None  # no step of 8 rows measured
    assert abs(speculator._floor(rows=4, decoding=3) - 4.6) < 1e-9
    assert "a check 25.0 ms" in costs.check_summary()
    assert "1.50 accepted tokens" in costs.check_summary()
    for _ in range(40):
        costs.checked(8 * MS)  # a device where a check is cheaper than a step
    assert speculator._floor(rows=1, decoding=0) == 0.0
