"""The step costs inside an engine: what stats() reports once spans ran, and speculation's
floor from the measured checks (the pure decisions: tests/unit/test_step_costs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import ChatRequest, Engine, TextRequest
from engine.core.step_costs import WARM_SPANS
from tests.conftest import greedy
from tests.engine.test_engine_tools import ASK, CLOCK
from tests.unit.test_step_costs import MS, measured
from tests.unit.test_tools import WEATHER


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
    from engine.core.step_costs import WARM_CHECKS
    from engine.device.speedups.speculator import Speculator

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
