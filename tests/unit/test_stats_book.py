"""engine.core.stats.StatsBook: the one writer of an engine's figures (no model)."""

from __future__ import annotations

import threading

import pytest

from engine.core.stats import StatsBook
from engine.requests.outbound.results import FinishReason


def test_endings_count_by_outcome_and_leave_running_or_pending() -> None:
    book = StatsBook()
    book.set(running=2, pending=1)
    book.ended(FinishReason.STOP, was_running=True, was_pending=False)
    book.ended(FinishReason.CANCELLED, was_running=False, was_pending=True)
    book.ended(FinishReason.ERROR, was_running=False, was_pending=False)  # never admitted
    stats = book.snapshot()
    assert (stats.completed, stats.cancelled, stats.failed) == (1, 1, 1)
    assert (stats.running, stats.pending) == (1, 0)
    book.ended(FinishReason.LENGTH, was_running=True, was_pending=False)
    book.ended(FinishReason.LENGTH, was_running=True, was_pending=False)
    assert book.snapshot().running == 0  # never below zero


def test_an_ending_takes_what_the_row_held_out_of_the_gauges_at_once() -> None:
    book = StatsBook()
    book.set(running=1, kv_bytes_projected=4096, live_matchers=1)
    book.ended(FinishReason.STOP, was_running=True, was_pending=False,
               kv_bytes_projected=0, live_matchers=0)
    stats = book.snapshot()
    assert (stats.running, stats.kv_bytes_projected, stats.live_matchers) == (0, 0, 0)


def test_steps_add_up_and_keep_the_widest() -> None:
    book = StatsBook()
    book.stepped(0.5, width=3, tokens=3, forced=1, drafted=0)
    book.stepped(0.25, width=2, tokens=4, forced=0, drafted=2)
    stats = book.snapshot()
    assert (stats.steps, stats.step_seconds, stats.peak_running) == (2, 0.75, 3)
    assert (stats.generated_tokens, stats.forced_tokens, stats.drafted_tokens) == (7, 1, 2)


def test_a_snapshot_is_a_copy_and_unknown_fields_are_refused() -> None:
    book = StatsBook()
    snap = book.snapshot()
    book.add(prompt_tokens=5)
    assert snap.prompt_tokens == 0 and book.snapshot().prompt_tokens == 5
    with pytest.raises(AttributeError, match="no_such_gauge"):
        book.set(no_such_gauge=1)


def test_writers_on_many_threads_lose_no_count() -> None:
    book = StatsBook()

    def work() -> None:
        for _ in range(2000):
            book.add(prompt_tokens=1)
            book.ended(FinishReason.STOP, was_running=False, was_pending=False)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = book.snapshot()
    assert stats.prompt_tokens == stats.completed == 8000
