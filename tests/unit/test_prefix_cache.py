"""The prefix store's bounds (LRU, TTL, bytes), with hand-built entries (no mlx)."""

from __future__ import annotations

from engine.core.prefix_cache import PrefixStore


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
