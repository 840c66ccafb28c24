"""Prefix reuse on the tiny model: identical output with reuse, donation, eviction."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from tests.conftest import greedy, kv_bytes_for, prompt_renderer, request_for, wait_until


def system_head(words: int = 150) -> str:
    return "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(words))


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_head()},
            {"role": "user", "content": f"Question number {i}: what now?"}]


def run_two_turns(eng: Engine, n: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]],
                                                 list[int], list[int]]:
    firsts = [eng.submit(request_for(conversation(i), greedy(12))) for i in range(n)]
    first = [h.result(timeout=120) for h in firsts]
    followups = []
    for i, result in enumerate(first):
        history = [*conversation(i), {"role": "assistant", "content": result.text},
                   {"role": "user", "content": "And then?"}]
        followups.append(eng.submit(request_for(history, greedy(12))))
    second = [h.result(timeout=120) for h in followups]
    return ([r.token_ids for r in first], [r.token_ids for r in second],
            [r.usage.cached_tokens for r in first], [r.usage.cached_tokens for r in second])


def test_reuse_never_changes_greedy_output(tiny_model_dir: Path) -> None:
    with Engine(tiny_model_dir, EngineConfig(max_batch=8, prefix_cache_bytes=0)) as cold:
        cold_first, cold_second, cold_c1, cold_c2 = run_two_turns(cold, 6)
        assert cold.stats().prefix_hits == 0
    assert set(cold_c1) | set(cold_c2) == {0}
    with Engine(tiny_model_dir, EngineConfig(max_batch=8)) as warm:
        first, second, cached_first, cached_second = run_two_turns(warm, 6)
        stats = warm.stats()
    assert first == cold_first and second == cold_second
    head = warm_head_len(tiny_model_dir)
    # Parallel first turns share the head: one row prefills it, the others reuse it.
    assert sum(c >= head for c in cached_first) >= 5
    # Second turns reuse the whole first turn (prompt + answer), not just the head.
    assert all(c > head for c in cached_second)
    assert stats.prefix_hits >= 11 and stats.prefix_hit_tokens >= sum(cached_second)
    assert stats.prefix_bytes > 0 and stats.prefix_entries > 0


def warm_head_len(model_dir: Path) -> int:
    with Engine(model_dir) as eng:
        return prompt_renderer(eng).encode_request(conversation(0), (), {}).head_len


def test_a_running_row_donates_its_prefix(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=4)
    base = [{"role": "user", "content": "tell me about " + " ".join(["cats"] * 120)}]
    tokens: list[int] = []
    long_one = eng.submit(request_for(base, greedy(400)), on_token=lambda t, _: tokens.append(t))
    wait_until(lambda: len(tokens) > 3)
    assert eng.stats().prefix_entries == 0  # nothing finished yet
    twin = eng.submit(request_for(base, greedy(5))).result()
    assert twin.usage.cached_tokens >= twin.usage.prompt_tokens - 1
    long_one.cancel()
    reference = make_engine(prefix_cache_bytes=0).submit(request_for(base, greedy(5))).result()
    assert twin.token_ids == reference.token_ids


def test_cache_shrinks_before_a_request_waits(make_engine) -> None:  # type: ignore[no-untyped-def]
    budget = kv_bytes_for(make_engine, 600)
    eng = make_engine(kv_budget_bytes=budget, max_batch=4)
    for i in range(6):  # fill the cache with distinct finished conversations
        eng.submit(request_for([{"role": "user", "content": f"story {i} " * 30}],
                               greedy(20))).result()
    assert eng.stats().prefix_bytes > 0
    big = eng.submit(request_for([{"role": "user", "content": "a new topic " * 40}],
                                 greedy(200))).result()
    assert big.usage.completion_tokens == 200
    stats = eng.stats()
    assert stats.prefix_evictions > 0
    assert stats.prefix_bytes + stats.kv_bytes_projected <= budget


@pytest.mark.parametrize("max_batch", [1, 6])
def test_cancelled_rows_do_not_disturb_later_reuse(make_engine, max_batch: int) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=max_batch)
    cold = make_engine(prefix_cache_bytes=0)
    prompt = conversation(3)
    expected = cold.submit(request_for(prompt, greedy(20))).result().token_ids
    tokens: list[int] = []
    victim = eng.submit(request_for(prompt, greedy(300)), on_token=lambda t, _: tokens.append(t))
    wait_until(lambda: len(tokens) > 5)
    victim.cancel()
    again = eng.submit(request_for(prompt, greedy(20))).result()
    assert again.token_ids == expected and again.usage.cached_tokens > 0


@pytest.mark.parametrize("system", [None, "You are terse."], ids=["no_system", "system"])
def test_rows_admitted_together_prefill_their_shared_prefix_once(
        tiny_model_dir: Path, system: str | None) -> None:
    # Without a system message there is no chat head: only the prompts' common text is
    # shared. With one, the shared part is the whole common prefix, not only the head.
    shared = "Please answer briefly. " + " ".join(f"fact{i}" for i in range(60))
    head = [{"role": "system", "content": system}] if system else []
    prompts = [[*head, {"role": "user", "content": f"{shared} Which is number {i}?"}]
               for i in range(6)]
    with Engine(tiny_model_dir, EngineConfig(max_batch=8, prefix_cache_bytes=0)) as cold:
        expected = [cold.submit(request_for(p, greedy(10))).result(timeout=120).token_ids
                    for p in prompts]
    with Engine(tiny_model_dir, EngineConfig(max_batch=8, prefill_batch=8)) as warm:
        warm.start()
        common = len(warm.tokenizer.encode(shared, add_special_tokens=False))
        handles = [warm.submit(request_for(p, greedy(10))) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
        stats = warm.stats()
    assert [r.token_ids for r in results] == expected
    cached = [r.usage.cached_tokens for r in results]
    # The first row prefills the shared prefix; the other five start from its stored copy.
    assert cached[0] == 0 and all(c >= common for c in cached[1:])
    assert stats.prefix_hits >= 5
    assert stats.prompt_tokens == sum(r.usage.prompt_tokens for r in results)
