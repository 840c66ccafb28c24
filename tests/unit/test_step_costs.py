"""The step costs' decisions, pure: forced spans taken where their measured cost is below
the steps they save, on the device's own figures (a GPU's cheap tokens, a CPU's dear ones),
speculation's acceptance floor, and image work's budget."""

from __future__ import annotations

from engine.core.step_costs import WARM_CHECKS, WARM_SPANS, ForwardCost, StepCosts, min_span

MS = 1e-3


def measured(steps: dict[int, float], span_fixed: float, per_token: float,
             tokens: tuple[int, ...] = (8, 16, 24, 40)) -> StepCosts:
    """Costs as the lane would have measured them: plain steps by width, span steps."""
    costs = StepCosts()
    for _ in range(10):
        for width, seconds in steps.items():
            costs.stepped(width, seconds)
    width = min(steps)
    for fed in tokens:
        costs.spanned(width, fed, steps[width] + span_fixed + per_token * fed)
    return costs


def test_before_anything_is_measured_the_shipped_thresholds_decide() -> None:
    costs = StepCosts()
    assert costs.shortest([5], 1, 1) == min_span(1) == 3
    costs.stepped(4, 50 * MS)
    assert costs.shortest([5, 9], 4, 4) == min_span(4) == 8  # no span measured yet
    assert "until their cost is measured" in costs.summary()


# This machine's default model as the probe times it: 13 ms a forward + 3.3 ms a token.
CPU_PRIOR = ForwardCost(fixed=13 * MS, per_token=3.3 * MS)


def test_before_anything_is_measured_the_load_time_forward_prices_spans() -> None:
    """A user's first agent batch: no step or span timed yet. Alone, a 3-token span costs
    two fixed forwards and its tokens (36 ms) against three 16 ms steps: taken; 2 tokens
    are not. Eight rows all spanning 19 tokens skip 19 steps of 8 rows (39 ms each, 741
    ms) for 528 ms: taken. Six of eight rows spanning 8 tokens save only their share of
    each step while leaving and rejoining copies the batch's KV, which the prior cannot
    price: declined until spans are measured."""
    costs = StepCosts(prior=CPU_PRIOR)
    assert costs.shortest([3], 1, 1) == 2
    assert costs.shortest([2], 1, 1) == 3
    assert costs.shortest([19] * 8, 8, 8) == 2
    assert costs.shortest([8] * 6, 8, 8) == 9
    assert costs.taken == 2 and costs.declined == 2
    assert "forward timed at the first span (13.0 ms + 3.30 ms a token)" in costs.summary()


def test_the_prior_is_timed_at_the_first_span_decision_not_before() -> None:
    """An engine that never meets a span never runs the probe's forwards; a report (stats)
    does not run them either."""
    timed: list[int] = []

    def probe() -> ForwardCost:
        timed.append(1)
        return CPU_PRIOR

    costs = StepCosts(prior=probe)
    assert "a forward timed at the first span until" in costs.summary() and not timed
    assert costs.shortest([], 1, 1) == 2 and not timed  # no span: nothing to price
    assert costs.shortest([3], 4, 4) == 4 and not timed  # beside decoding rows: not priced
    assert costs.shortest([3], 1, 1) == 2 and timed == [1]
    assert costs.shortest([3], 1, 1) == 2 and timed == [1]  # timed once
    assert StepCosts(measured=False, prior=probe).shortest([3], 1, 1) == 3 and timed == [1]


def test_spans_beside_decoding_rows_save_only_their_share_of_a_step() -> None:
    """Where a token costs little next to a forward (a GPU), every row spanning three
    tokens skips three 20 ms steps for 41 ms; two rows of eight spanning 12 tokens save
    only their tokens' share (1.2 ms), far below a span's fixed cost, on either device."""
    gpu = StepCosts(prior=ForwardCost(fixed=20 * MS, per_token=0.05 * MS))
    cpu = StepCosts(prior=CPU_PRIOR)
    assert gpu.shortest([3] * 8, 8, 8) == 2
    assert gpu.shortest([12] * 2, 8, 8) == 13
    assert cpu.shortest([12] * 2, 8, 8) == 13


def test_measurements_replace_the_prior_as_they_come() -> None:
    """A measured step replaces the prior at its width; after WARM_SPANS spans, their
    fitted line replaces its span cost: here spans measured far dearer than the prior
    said are declined where the prior took them."""
    costs = StepCosts(prior=CPU_PRIOR)
    assert costs.shortest([5], 1, 1) == 2
    for _ in range(10):
        costs.stepped(1, 16 * MS)
    for fed in (5, 9, 13, 19):
        costs.spanned(1, fed, 16 * MS + 60 * MS + 20 * MS * fed)
    assert costs.shortest([5], 1, 1) == 6
    assert "a span 60.0 ms + 20.00 ms a token" in costs.summary()


def test_a_rows_share_of_a_step_is_the_slope_over_widths_not_two_neighbours() -> None:
    """Steps measured on a shared CPU (16 schema rows from a fresh process): 10 rows 46.4 ms
    beside 8 rows 29.3 ms read as 8.6 ms a row from the neighbours, which took a span that
    lost. The least-squares slope over every width, at most the step's mean a row, is
    what a row's share is read as."""
    costs = StepCosts(prior=CPU_PRIOR)
    for width, seconds in ((5, 29.1 * MS), (8, 29.3 * MS), (10, 46.4 * MS), (13, 64.6 * MS)):
        for _ in range(5):
            costs.stepped(width, seconds)
    # The slope, 4.68 ms, is capped at a step of 10's mean a row, 4.64 ms (not 8.6 ms).
    assert abs(costs._share(10) - 4.64 * MS) < 1e-9
    assert abs(costs._share(13) - 159.1 / 34 * MS) < 1e-9  # the slope itself, below 4.97


def test_a_sharded_lane_has_no_prior() -> None:
    assert StepCosts(measured=False, prior=CPU_PRIOR).shortest([19] * 8, 8, 8) == min_span(8)


def test_unmeasured_costs_keep_the_shipped_thresholds_however_much_is_timed() -> None:
    """A sharded engine's ranks time their own steps: decisions made from the timings
    could differ between ranks and split their collectives, so there the thresholds
    decide for good."""
    timed = measured({1: 5 * MS, 8: 6 * MS}, span_fixed=2 * MS, per_token=0.1 * MS)
    fixed = StepCosts(measured=False)
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


def test_a_check_needs_the_fixed_floor_until_checks_are_timed_then_what_pays() -> None:
    costs = measured({1: 10 * MS, 3: 18 * MS, 4: 20 * MS}, 0.0, 1 * MS)
    assert costs.acceptance_needed(rows=2, decoding=1, fixed_floor=0.5) == 1.0
    for _ in range(WARM_CHECKS):
        costs.checked(25 * MS)
    assert abs(costs.acceptance_needed(rows=4, decoding=3, fixed_floor=0.5) - 4.6) < 1e-9
    for _ in range(40):
        costs.checked(8 * MS)  # a check cheaper than a step: any acceptance pays
    assert costs.acceptance_needed(rows=1, decoding=0, fixed_floor=0.5) == 0.0


def test_image_work_earns_a_share_of_the_measured_step() -> None:
    costs = StepCosts()
    assert costs.image_budget(0, 0.1) is None  # nothing decodes: image work runs through
    assert costs.image_budget(3, 0.1) == 0.0  # no step measured: one unit a step
    for _ in range(5):
        costs.stepped(2, 40 * MS)
    assert abs(costs.image_budget(3, 0.1) - 4 * MS) < 1e-12  # the nearest width measured
