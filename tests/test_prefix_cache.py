"""Prefix reuse: the store's bounds (LRU, TTL, bytes) and identical output with reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.prefix_cache import PrefixStore
from tests.conftest import greedy, wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_lookup_takes_the_longest_prefix_and_leaves_a_token_to_prefill() -> None:
    store = PrefixStore(10_000, None, min_tokens=2)
    store.insert([1, 2, 3], "short", 10)
    store.insert([1, 2, 3, 4, 5, 6], "long", 10)
    store.insert([9, 9, 9, 9], "other", 10)
    hit = store.lookup([1, 2, 3, 4, 7])
    assert hit is not None and hit.entry.cache == "long" and hit.tokens == 4
    whole = store.lookup([1, 2, 3, 4, 5, 6])
    assert whole is not None and whole.tokens == 5  # the last token is always prefilled
    assert store.lookup([5, 5, 5]) is None
    assert (store.stats.hits, store.stats.misses) == (2, 1)


def test_an_entry_that_a_new_one_extends_is_dropped() -> None:
    store = PrefixStore(10_000, None, min_tokens=2)
    store.insert([1, 2, 3], "a", 10)
    store.insert([1, 2, 3, 4], "b", 10)
    assert [e.cache for e in store.entries()] == ["b"]
    assert store.insert([1, 2], "c", 10) is not None  # covered by "b": nothing new kept
    assert [e.cache for e in store.entries()] == ["b"]


def test_byte_cap_evicts_least_recently_used() -> None:
    store = PrefixStore(250, None, min_tokens=1)
    store.insert([1, 1], "a", 100)
    store.insert([2, 2], "b", 100)
    store.lookup([1, 1, 5])  # touch a: b is now the least recently used
    store.insert([3, 3], "c", 100)
    assert sorted(e.cache for e in store.entries()) == ["a", "c"]
    assert store.nbytes <= 250 and store.stats.evictions == 1
    assert store.insert([4, 4], "huge", 1000) is None  # bigger than the cap: not kept


def test_ttl_expiry_checks_every_entry_not_just_the_lru_head() -> None:
    clock = Clock()
    store = PrefixStore(10_000, ttl=60, min_tokens=1, now=clock)
    store.insert([1, 1, 1], "old", 10)
    clock.t += 50
    store.insert([2, 2, 2], "new", 10)
    store.lookup([1, 1, 1, 9])  # LRU order is now [new, old]: recency, not age
    clock.t += 20  # old is 70 s old (expired), new 20 s (fresh)
    # An oldest-first walk over LRU order meets "new" first and would stop there.
    assert store.expire() == 1
    assert [e.cache for e in store.entries()] == ["new"]


def test_recurrent_state_is_reused_only_on_an_exact_boundary() -> None:
    store = PrefixStore(10_000, None, min_tokens=1)
    store.insert([1, 2, 3], "ssm", 10, trimmable=False)
    assert store.lookup([1, 2, 4, 5]) is None
    hit = store.lookup([1, 2, 3, 4])
    assert hit is not None and hit.tokens == 3


def system_head(words: int = 150) -> str:
    return "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(words))


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_head()},
            {"role": "user", "content": f"Question number {i}: what now?"}]


def run_two_turns(eng: Engine, n: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]],
                                                 list[int], list[int]]:
    firsts = [eng.submit(conversation(i), greedy(12)) for i in range(n)]
    first = [h.result(timeout=120) for h in firsts]
    followups = []
    for i, result in enumerate(first):
        history = [*conversation(i), {"role": "assistant", "content": result.text},
                   {"role": "user", "content": "And then?"}]
        followups.append(eng.submit(history, greedy(12)))
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
        eng.start()
        return eng._preparer.prompts.encode_request(conversation(0), (), {}).head_len


def test_a_running_row_donates_its_prefix(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=4)
    base = [{"role": "user", "content": "tell me about " + " ".join(["cats"] * 120)}]
    tokens: list[int] = []
    long_one = eng.submit(base, greedy(400), on_token=lambda t, _: tokens.append(t))
    wait_until(lambda: len(tokens) > 3)
    assert eng.stats().prefix_entries == 0  # nothing finished yet
    twin = eng.submit(base, greedy(5)).result()
    assert twin.usage.cached_tokens >= twin.usage.prompt_tokens - 1
    long_one.cancel()
    reference = make_engine(prefix_cache_bytes=0).submit(base, greedy(5)).result()
    assert twin.token_ids == reference.token_ids


def test_cache_shrinks_before_a_request_waits(make_engine) -> None:  # type: ignore[no-untyped-def]
    probe = make_engine()
    footprint = probe._scheduler.footprint
    budget = footprint.bytes_for(600)
    eng = make_engine(kv_budget_bytes=budget, max_batch=4)
    for i in range(6):  # fill the cache with distinct finished conversations
        eng.submit([{"role": "user", "content": f"story {i} " * 30}], greedy(20)).result()
    assert eng.stats().prefix_bytes > 0
    big = eng.submit([{"role": "user", "content": "a new topic " * 40}], greedy(200)).result()
    assert big.usage.completion_tokens == 200
    stats = eng.stats()
    assert stats.prefix_evictions > 0
    assert stats.prefix_bytes + stats.kv_bytes_projected <= budget


@pytest.mark.parametrize("max_batch", [1, 6])
def test_cancelled_rows_do_not_disturb_later_reuse(make_engine, max_batch: int) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=max_batch)
    cold = make_engine(prefix_cache_bytes=0)
    prompt = conversation(3)
    expected = cold.submit(prompt, greedy(20)).result().token_ids
    tokens: list[int] = []
    victim = eng.submit(prompt, greedy(300), on_token=lambda t, _: tokens.append(t))
    wait_until(lambda: len(tokens) > 5)
    victim.cancel()
    again = eng.submit(prompt, greedy(20)).result()
    assert again.token_ids == expected and again.usage.cached_tokens > 0
