"""StepProbe, the engine's test seam: armed faults are raised the number of times asked."""

from __future__ import annotations

import pytest

from engine.core.stats import EngineStats
from engine.core.step_probe import StepProbe, TurnReport


def test_an_unarmed_probe_never_raises() -> None:
    probe = StepProbe()
    for _ in range(3):
        probe.before_step("batch")
    assert probe.faults_raised == 0


def test_fail_next_raises_that_many_steps_then_stops() -> None:
    probe = StepProbe()
    fault = RuntimeError("injected")
    probe.fail_next(fault, steps=2)
    for _ in range(2):
        with pytest.raises(RuntimeError) as info:
            probe.before_step("batch")
        assert info.value is fault
    probe.before_step("serial")
    assert probe.faults_raised == 2


def test_fail_always_raises_until_stopped() -> None:
    probe = StepProbe()
    probe.fail_always(ValueError("again"))
    for _ in range(5):
        with pytest.raises(ValueError):
            probe.before_step("batch")
    probe.stop_failing()
    probe.before_step("batch")
    assert probe.faults_raised == 5


def test_turn_reports_reach_the_callback() -> None:
    seen: list[TurnReport] = []
    probe = StepProbe(on_turn=seen.append)
    report = TurnReport((3, 4), 100, 20, EngineStats())
    probe.turn_ended(report)
    StepProbe().turn_ended(report)  # no callback: nothing happens
    assert seen == [report]


@pytest.mark.parametrize("bad", [RuntimeError, "boom", KeyboardInterrupt()])
def test_only_exception_instances_can_be_armed(bad: object) -> None:
    with pytest.raises(TypeError, match="error"):
        StepProbe().fail_next(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [0, -1, True, 1.5])
def test_steps_must_be_a_positive_int(steps: object) -> None:
    with pytest.raises(ValueError, match="steps"):
        StepProbe().fail_next(RuntimeError("x"), steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("hook", ["on_turn", "on_step", "on_embed"])
def test_hooks_must_be_callable(hook: str) -> None:
    with pytest.raises(TypeError, match=hook):
        StepProbe(**{hook: 42})  # type: ignore[arg-type]


def test_on_step_sees_each_lane_step_before_its_fault() -> None:
    seen: list[str] = []
    probe = StepProbe(on_step=seen.append)
    probe.before_step("batch")
    probe.fail_next(RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        probe.before_step("serial")
    assert seen == ["batch", "serial"]


def test_on_embed_sees_each_batch_and_may_fail_it() -> None:
    seen: list[list[str]] = []
    probe = StepProbe(on_embed=seen.append)
    probe.before_embed(["a", "b"])
    StepProbe().before_embed(["c"])  # no hook: nothing happens
    assert seen == [["a", "b"]]


def test_engine_takes_only_a_step_probe() -> None:
    from engine import Engine

    with pytest.raises(TypeError, match="probe"):
        Engine("some/model", probe=object())  # type: ignore[arg-type]


def test_slow_steps_sleeps_before_each_step_until_undone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.core.step_probe as module

    slept: list[float] = []
    monkeypatch.setattr(module.time, "sleep", slept.append)
    probe = StepProbe()
    probe.before_step("batch")
    probe.slow_steps(0.25)
    probe.before_step("batch")
    probe.before_step("serial")
    probe.slow_steps(0)
    probe.before_step("batch")
    assert slept == [0.25, 0.25]


@pytest.mark.parametrize("seconds", [-1, float("inf"), float("nan"), "1", True, None])
def test_slow_steps_needs_a_finite_non_negative_number(seconds: object) -> None:
    with pytest.raises(ValueError, match="seconds"):
        StepProbe().slow_steps(seconds)  # type: ignore[arg-type]
