"""Churn in CI: requests of every kind from threads, asyncio and trio, cancelled at every
stage, with raising callbacks and processors; afterwards nothing is left behind and every
count adds up. ``bench/soak.py`` runs the same workload for much longer and prints memory.
"""

from __future__ import annotations

import os

from engine import Engine
from testkit.churn import NEEDLES, Churn
from tests.conftest import wait_until

# 600 reach every stage, kind and outcome the test asserts on many times over (seed 7);
# MLX_PROVIDERS_SOAK_REQUESTS=2000 (or bench/soak.py) churns longer.
REQUESTS = int(os.environ.get("MLX_PROVIDERS_SOAK_REQUESTS", "600"))


def test_churn_leaves_nothing_behind_and_counts_add_up(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng: Engine = make_engine(max_batch=16)
    churn = Churn(eng, seed=7)
    churn.run_round(REQUESTS)
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=60)
    stats, report = eng.stats(), churn.report
    assert report.submitted == REQUESTS
    assert report.needles >= REQUESTS // 50 and report.needle_mismatches == 0
    assert stats.live_matchers == 0 and stats.kv_bytes_projected == 0
    # Every request the engine accepted ended exactly once (the needles' reference runs too).
    assert stats.completed + stats.cancelled + stats.failed == REQUESTS + len(NEEDLES)
    # Every stage and every kind was exercised, and only the expected errors came out.
    assert all(report.by_stage[s] > 0 for s in ("before_admission", "after_tokens", "break",
                                                 "aclose", "task_cancel", "timeout",
                                                 "move_on_after"))
    assert all(report.by_kind[k] > 0 for k in ("plain", "seeded", "tool", "bad_callback",
                                                "bad_processor"))
    allowed = {"stop", "length", "cancelled", "tool_calls", "cancelled_by_caller",
               "stop_or_length", "RequestTimeoutError", "_CallbackBug", "ValueError"}
    assert set(report.outcomes) <= allowed, report.outcomes
    assert report.outcomes["_CallbackBug"] > 0 and report.outcomes["ValueError"] > 0
    assert stats.failed >= report.outcomes["_CallbackBug"] + report.outcomes["ValueError"]
