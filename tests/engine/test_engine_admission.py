"""Admission: context-length and KV-budget rejection, waiting, max_batch."""

from __future__ import annotations

import pytest

from engine import ContextLengthError, Engine, FinishReason, KVBudgetError, TextRequest
from tests.conftest import alone, greedy, kv_bytes_for, prompts_of_lengths, request_for, wait_until


def test_context_overflow_is_rejected_and_nothing_else_is_affected(tiny_engine: Engine) -> None:
    ok_prompt, huge = prompts_of_lengths(tiny_engine, [20, 2000])
    expected = alone(tiny_engine, [ok_prompt], greedy(20))[0]
    sibling = tiny_engine.submit(request_for(ok_prompt, greedy(20)))
    bad = tiny_engine.submit(request_for(huge, greedy(100)))
    with pytest.raises(ContextLengthError) as info:
        bad.result()
    assert "2000" in str(info.value) and "100" in str(info.value) and "2048" in str(info.value)
    assert sibling.result().token_ids == expected
    assert tiny_engine.stats().failed == 1


def test_kv_budget_rejects_what_cannot_fit_alone(make_engine) -> None:  # type: ignore[no-untyped-def]
    per_row = kv_bytes_for(make_engine, 100)
    eng = make_engine(kv_budget_bytes=per_row)
    prompt = prompts_of_lengths(eng, [60])[0]
    with pytest.raises(KVBudgetError, match="kv_budget_bytes"):
        eng.submit(request_for(prompt, greedy(60))).result()
    assert eng.submit(request_for(prompt, greedy(40))).result().finish_reason is FinishReason.LENGTH


def test_kv_budget_makes_requests_wait_fifo_without_deadlock(make_engine) -> None:  # type: ignore[no-untyped-def]
    # Room for two 100-token rows at once, not three.
    eng = make_engine(kv_budget_bytes=kv_bytes_for(make_engine, 100) * 2
                      + kv_bytes_for(make_engine, 50))
    prompts = prompts_of_lengths(eng, [50] * 6, seed=1)
    params = greedy(50)
    reference = alone(eng, prompts, params)
    running_seen: list[int] = []
    handles = [eng.submit(request_for(p, params), on_token=lambda *_: running_seen.append(
        eng.stats().running) or None) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == reference
    assert max(running_seen) == 2
    assert eng.stats().peak_running == 2
    wait_until(lambda: eng.stats().kv_bytes_projected == 0)


def test_max_batch_bounds_rows_and_off_mode(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=3)
    prompts = prompts_of_lengths(eng, [10] * 7)
    handles = [eng.submit(request_for(p, greedy(20))) for p in prompts]
    for h in handles:
        h.result()
    assert eng.stats().peak_running == 3
    assert eng.stats().batch_mode == "batch"
    off = make_engine(max_batch=1)
    assert off.stats().batch_mode == "off"


def test_bad_requests_fail_alone(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.submit(TextRequest("", greedy())).result()
    with pytest.raises(ValueError, match="out of range"):
        tiny_engine.submit(request_for([1, 10**9], greedy())).result()
    with pytest.raises(TypeError):
        tiny_engine.submit(request_for(None, greedy()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        tiny_engine.submit(TextRequest("x", greedy()), timeout=0)
    assert tiny_engine.submit(TextRequest("fine", greedy(3))).result().usage.completion_tokens == 3
