"""Memory bounds under pressure: a storm of long and short requests on small budgets.

Every turn of the engine loop is sampled through ``StepProbe(on_turn=...)``: the worst-case
KV bytes of the running rows (right after admission, the turn's peak, and after the steps)
never exceed ``kv_budget_bytes``, nor do they with the prefix cache's bytes added (cached
prefixes count against the budget); the prefix cache never holds more than
``prefix_cache_bytes``. Every request that fits alone finishes (no deadlock), one of them
needing nearly the whole budget, and requests are admitted in submit order (FIFO). Some
long rows are cancelled mid-decode, so evicted rows store their KV while others are admitted.
"""

from __future__ import annotations

import random
import time

from engine import Engine, FinishReason, RequestHandle, SamplingParams, StepProbe, TurnReport
from tests.conftest import greedy, prompts_of_lengths, request_for


def _bytes_per_token(make_engine) -> int:  # type: ignore[no-untyped-def]
    """What the scheduler projects per token of a row (tiny qwen2: plain KV caches)."""
    seen: list[TurnReport] = []
    eng = make_engine(probe=StepProbe(on_turn=seen.append))
    eng.submit(request_for([5] * 10, greedy(10))).result(timeout=60)
    projected = max(report.kv_bytes_projected for report in seen)
    assert projected > 0 and projected % 20 == 0
    return projected // 20


def test_storm_of_long_and_short_requests_stays_within_budgets_fifo_without_deadlock(
        make_engine) -> None:  # type: ignore[no-untyped-def]
    per_token = _bytes_per_token(make_engine)
    budget, cache_cap = 1200 * per_token, 300 * per_token
    reports: list[TurnReport] = []
    probe = StepProbe(on_turn=reports.append)
    eng: Engine = make_engine(probe=probe, max_batch=8, prefill_batch=4, prefill_chunk=64,
                              kv_budget_bytes=budget, prefix_cache_bytes=cache_cap,
                              prefix_min_tokens=16)
    rng = random.Random(14)
    shared = prompts_of_lengths(eng, [180], seed=140)[0]  # a long common head for some
    requests: list[tuple[object, SamplingParams]] = []
    for i in range(48):
        kind = rng.random()
        if i == 30:  # fits alone, and only when nearly everything else has drained
            prompt: object = prompts_of_lengths(eng, [1000], seed=141)[0]
            params = greedy(100, ignore_eos=True)
        elif kind < 0.3:  # long, sharing a head with other long ones
            tail = prompts_of_lengths(eng, [rng.randrange(20, 200)], seed=1000 + i)[0]
            prompt, params = shared + tail, greedy(rng.randrange(20, 60), ignore_eos=True)
        elif kind < 0.5:  # long and unrelated
            prompt = prompts_of_lengths(eng, [rng.randrange(200, 450)], seed=2000 + i)[0]
            params = greedy(rng.randrange(20, 60), ignore_eos=True)
        elif kind < 0.6:  # a chat request with the shared system message (a stored head)
            prompt = [{"role": "system", "content": "You are terse. " * 40},
                      {"role": "user", "content": f"question {i}"}]
            params = greedy(rng.randrange(4, 16), ignore_eos=True)
        else:  # short
            prompt = prompts_of_lengths(eng, [rng.randrange(8, 40)], seed=3000 + i)[0]
            params = greedy(rng.randrange(4, 12), ignore_eos=True)
        requests.append((prompt, params))

    cancelled = {i for i, (_, params) in enumerate(requests)
                 if i % 5 == 2 and params.max_tokens >= 20}
    handles: dict[int, RequestHandle] = {}

    def cancel_after_three(i: int):  # type: ignore[no-untyped-def]
        seen = [0]

        def on_token(_token: int, _delta: str) -> None:
            seen[0] += 1
            if seen[0] >= 3 and i in handles:  # runs on the engine thread
                handles[i].cancel()
        return on_token

    for i, (prompt, params) in enumerate(requests):  # in bursts, into a running engine
        handles[i] = eng.submit(request_for(prompt, params),
                                on_token=cancel_after_three(i) if i in cancelled else None)
        if i % 12 == 11:
            time.sleep(0.05)
    results = [handles[i].result(timeout=120) for i in range(len(requests))]

    # No deadlock: every request ran to its length, the big one included, or was cancelled.
    assert len(cancelled) >= 3
    for i, (result, (_, params)) in enumerate(zip(results, requests, strict=True)):
        if i in cancelled:
            assert result.finish_reason is FinishReason.CANCELLED
        else:
            assert result.finish_reason is FinishReason.LENGTH
            assert result.usage.completion_tokens == params.max_tokens

    # The budgets held at every turn, at the turn's peak and after its steps.
    assert reports
    for report in reports:
        assert report.kv_bytes_projected <= budget
        assert report.kv_bytes_projected + report.prefix_bytes <= budget
        stats = report.stats
        assert stats.kv_bytes_projected + stats.prefix_bytes <= budget
        assert stats.prefix_bytes <= cache_cap
        assert stats.running <= 8

    # FIFO: admitted in submit order.
    ids = [handles[i].request_id for i in range(len(requests))]
    admitted = [i for report in reports for i in report.admitted if i in set(ids)]
    assert admitted == ids

    # The storm did press on every bound (or the test proves nothing).
    peak = max(r.kv_bytes_projected for r in reports)
    peak_total = max(r.kv_bytes_projected + r.prefix_bytes for r in reports)
    final = eng.stats()
    assert peak >= 1100 * per_token  # the big request ran
    assert max(r.stats.pending for r in reports) >= 3  # requests had to wait
    assert final.prefix_hits > 0 and final.prefix_evictions > 0
    assert final.running == 0 and final.pending == 0 and final.kv_bytes_projected == 0
    print(f"\nstorm: {len(requests)} requests ({len(cancelled)} cancelled), {len(reports)} "
          f"turns, budget {budget} B, "
          f"peak projected {peak} B ({peak / budget:.0%}), peak projected+prefix {peak_total} B "
          f"({peak_total / budget:.0%}), prefix cap {cache_cap} B, peak prefix "
          f"{max(r.stats.prefix_bytes for r in reports)} B, hits {final.prefix_hits}, "
          f"evictions {final.prefix_evictions}, peak running {final.peak_running}")
