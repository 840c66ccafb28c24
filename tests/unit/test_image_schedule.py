"""When image work runs beside decoding rows: a credit earned each step, spent by units,
repaid when a unit overruns it."""

from __future__ import annotations

from engine.core.image_schedule import ImageSchedule


def _units(schedule: ImageSchedule, budget: float | None, costs: list[float]) -> int:
    """Run units costing ``costs`` (in turn) while the schedule allows; how many ran."""
    schedule.earn(budget)
    ran = 0
    while ran < len(costs) and schedule.may_run():
        schedule.spent(costs[ran])
        ran += 1
    return ran


def test_with_no_row_decoding_every_unit_runs() -> None:
    assert _units(ImageSchedule(), None, [1.0] * 7) == 7


def test_before_a_step_is_measured_one_unit_a_step() -> None:
    schedule = ImageSchedule()
    assert [_units(schedule, 0.0, [5.0] * 3) for _ in range(3)] == [1, 1, 1]


def test_a_unit_past_the_credit_is_repaid_by_later_steps() -> None:
    schedule = ImageSchedule()
    # 10 ms a step earned, a 35 ms unit: it runs (25 ms owed), two steps repay most of
    # it and the third's credit is positive again: one unit in four steps, ~1/(1 + share).
    assert _units(schedule, 0.010, [0.035]) == 1
    assert [_units(schedule, 0.010, [0.035]) for _ in range(3)] == [0, 0, 1]


def test_credit_saves_up_two_steps_at_most_and_none_once_idle() -> None:
    schedule = ImageSchedule()
    for _ in range(5):
        schedule.earn(0.010)
    assert abs(schedule.credit - 0.020) < 1e-12
    schedule.idle()
    assert schedule.credit == 0.0
    schedule.earn(0.010)
    schedule.spent(0.050)
    schedule.idle()
    assert schedule.credit < 0  # a debt stays


def test_a_prefill_unit_is_cut_to_what_the_credit_pays() -> None:
    assert ImageSchedule.chunk(512, None, 0.001) == 512
    assert ImageSchedule.chunk(512, 0.050, 0.001) == 50
    assert ImageSchedule.chunk(512, 0.001, 0.001) == 8  # a unit always moves
    assert ImageSchedule.chunk(512, 0.050, 0.0) == 512  # no token timed yet
