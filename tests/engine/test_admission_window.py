"""``admission_window``: an idle engine waits briefly after a request arrives, so a burst
starts as one prefill group instead of its first row alone ahead of the rest."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from engine import Engine, EngineClosedError, EngineConfig, SamplingParams, StepProbe
from engine.core.step_probe import TurnReport
from tests.conftest import request_for

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _admissions(make_engine: Callable[..., Engine], gap: float, n: int,
                **config: Any) -> list[tuple[int, ...]]:
    """Submit ``n`` requests ``gap`` s apart to an idle engine; each turn's admissions."""
    turns: list[tuple[int, ...]] = []

    def on_turn(report: TurnReport) -> None:
        if report.admitted:
            turns.append(report.admitted)

    eng = make_engine(probe=StepProbe(on_turn=on_turn), prefill_batch=4, **config)
    handles = []
    for i in range(n):
        handles.append(eng.submit(request_for([{"role": "user", "content": f"burst {i}"}], GREEDY)))
        time.sleep(gap)
    for handle in handles:
        handle.result(timeout=60)
    return turns


def test_a_burst_on_an_idle_engine_starts_as_one_group(make_engine: Any) -> None:
    # Without a window the engine starts the first request the moment it arrives.
    assert len(_admissions(make_engine, 0.05, 4)[0]) == 1
    assert [len(t) for t in _admissions(make_engine, 0.05, 4, admission_window=1.0)] == [4]
    # The window ends as soon as a full prefill group (4) waits: the 5th and 6th requests,
    # still inside the window, start in later turns.
    turns = _admissions(make_engine, 0.05, 6, admission_window=1.0)
    assert len(turns[0]) == 4 and sum(len(t) for t in turns) == 6


def test_the_window_ends_at_its_length_for_a_lone_request(make_engine: Any) -> None:
    eng = make_engine(admission_window=0.2, prefill_batch=4)
    started = time.monotonic()
    eng.submit(request_for([{"role": "user", "content": "alone"}], GREEDY)).result(timeout=60)
    assert time.monotonic() - started >= 0.2  # it waited the window, then ran alone


def test_close_during_a_window_does_not_wait_for_it(make_engine: Any) -> None:
    eng = make_engine(admission_window=1.0, prefill_batch=4)
    handle = eng.submit(request_for([{"role": "user", "content": "cut short"}], GREEDY))
    eng.close(timeout=0.9)  # joins the engine thread for at most 0.9 s, not the window
    assert handle.done
    with pytest.raises(EngineClosedError):
        handle.result(timeout=0)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_admission_window_is_validated(bad: float) -> None:
    with pytest.raises(ValueError, match="admission_window"):
        EngineConfig(admission_window=bad)
