"""The Responses store on a fake clock: TTL, byte cap, LRU order, copies."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_providers.server.responses_store import ResponseStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, rid: str, text: str = "x", **kw: Any) -> bool:
    return store.put(rid, input_items=[{"role": "user", "content": text}],
                     output_items=[{"type": "message", "content": [{"type": "output_text",
                                                                   "text": "ok"}]}],
                     instructions=kw.get("instructions"), response={"id": rid})


def test_entries_expire_by_age() -> None:
    clock = FakeClock()
    store = ResponseStore(ttl_seconds=10, clock=clock)
    put(store, "a")
    clock.now += 9.9
    assert store.get("a") is not None
    clock.now += 0.2
    assert store.get("a") is None
    assert len(store) == 0 and store.nbytes == 0 and store.expirations == 1


def test_an_entry_exactly_as_old_as_the_ttl_is_still_alive() -> None:
    """The boundary of the store this server follows: expired once older than the TTL."""
    clock = FakeClock()
    store = ResponseStore(ttl_seconds=10, clock=clock)
    put(store, "a")
    clock.now += 10
    assert store.get("a") is not None
    assert store.expire() == 0
    clock.now += 1e-6
    assert store.get("a") is None and store.expirations == 1


def test_a_touched_old_entry_still_expires_by_age() -> None:
    """LRU touches move an old entry to the end of the map; expiry must still find it."""
    clock = FakeClock()
    store = ResponseStore(ttl_seconds=10, clock=clock)
    put(store, "old")
    clock.now += 6
    put(store, "young")
    assert store.get("old") is not None  # now last in LRU order, behind "young"
    clock.now += 5  # old is 11 s old, young 5 s
    assert store.expire() == 1
    assert "old" not in store and "young" in store


def test_byte_cap_evicts_least_recently_used_first() -> None:
    clock = FakeClock()
    probe = ResponseStore(clock=clock)
    put(probe, "a")
    one = probe.nbytes
    store = ResponseStore(ttl_seconds=None, max_bytes=3 * one, clock=clock)
    for rid in "abc":
        put(store, rid)
    assert store.get("a") is not None  # a is now most recently used; b is least
    put(store, "d")
    assert "b" not in store
    assert all(rid in store for rid in "acd")
    assert store.nbytes <= store.max_bytes and store.evictions == 1


def test_an_entry_larger_than_the_cap_is_refused_and_evicts_nothing() -> None:
    store = ResponseStore(max_bytes=400, clock=FakeClock())
    assert put(store, "small")
    assert not put(store, "huge", text="y" * 1000)
    assert "huge" not in store and "small" in store


def test_the_store_keeps_copies() -> None:
    store = ResponseStore(clock=FakeClock())
    items = [{"role": "user", "content": "hi"}]
    store.put("r", input_items=items, output_items=[], instructions="be brief",
              response={"id": "r"})
    items[0]["content"] = "changed by the caller"
    got = store.get("r")
    assert got is not None and got.input_items[0]["content"] == "hi"
    got.input_items[0]["content"] = "changed by a reader"
    again = store.get("r")
    assert again is not None and again.input_items[0]["content"] == "hi"
    assert again.instructions == "be brief"


def test_history_is_input_then_output() -> None:
    store = ResponseStore(clock=FakeClock())
    put(store, "r", text="question")
    got = store.get("r")
    assert got is not None
    history = got.history()
    assert history[0] == {"role": "user", "content": "question"}
    assert history[1]["type"] == "message"


def test_replacing_and_deleting_keep_the_byte_count_right() -> None:
    store = ResponseStore(clock=FakeClock())
    put(store, "r")
    first = store.nbytes
    put(store, "r", text="a longer question than before")
    assert len(store) == 1 and store.nbytes > first
    assert store.delete("r") and not store.delete("r")
    assert store.nbytes == 0


@pytest.mark.parametrize("kw", [{"ttl_seconds": 0}, {"max_bytes": 0}])
def test_bad_bounds_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ResponseStore(**kw)
