"""Prompt-lookup speculation: the same greedy tokens as without it, in fewer steps.

The tiny model's random weights make it repeat itself, so drafts copied from its own
output are often right: speculation engages (``stats().drafted_tokens``), and the test is
that it changes nothing but the number of steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from engine import Engine, FinishReason
from tests.conftest import greedy, prompts_of_lengths, request_for, wait_until


@pytest.fixture
def engines(make_engine: Callable[..., Engine]) -> tuple[Engine, Engine]:
    """Speculation for up to four rows, and off."""
    return (make_engine(max_batch=16, prefill_chunk=64, speculation=4),
            make_engine(max_batch=16, prefill_chunk=64, speculation=0))


def repeating_prompts(eng: Engine, count: int) -> list[list[int]]:
    """One token said sixteen times: the tiny model tends to go on repeating it (or a
    short pattern), so drafts copied from the row's own tokens are accepted."""
    return [[token] * 16 for token in prompts_of_lengths(eng, [count], seed=1)[0]]


def test_speculation_keeps_the_greedy_tokens_in_fewer_steps(
        engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    prompts = repeating_prompts(on, 6)
    for prompt in prompts:
        before = on.stats().steps
        fast = on.submit(request_for(prompt, greedy(60))).result(timeout=60)
        fast_steps = on.stats().steps - before
        before = off.stats().steps
        slow = off.submit(request_for(prompt, greedy(60))).result(timeout=60)
        slow_steps = off.stats().steps - before
        assert fast.token_ids == slow.token_ids
        assert fast.usage.completion_tokens == slow.usage.completion_tokens
        assert fast_steps <= slow_steps
    stats = on.stats()
    assert stats.drafted_tokens > 0 and off.stats().drafted_tokens == 0
    assert stats.steps < off.stats().steps


def test_speculating_rows_rejoin_the_batch_when_load_rises(
        make_engine: Callable[..., Engine]) -> None:
    on = make_engine(max_batch=16, prefill_chunk=64, speculation=1)
    off = make_engine(max_batch=16, prefill_chunk=64, speculation=0)
    first, *others = repeating_prompts(on, 4)
    reference = [off.submit(request_for(p, greedy(80))).result(timeout=60).token_ids
                 for p in (first, *others)]
    drafting = threading.Event()

    def watch(_t: int, _d: str) -> None:
        if on.stats().drafted_tokens > 0:
            drafting.set()

    lead = on.submit(request_for(first, greedy(80)), on_token=watch)
    assert drafting.wait(60), "the lone row never speculated"
    rest = [on.submit(request_for(p,
                                  greedy(80))) for p in others]  # now four rows: back to the batch
    got = [h.result(timeout=60).token_ids for h in (lead, *rest)]
    assert got == reference
    assert on.stats().peak_running >= 2


@pytest.mark.parametrize("limit", [1, 5, 13, 31])
def test_max_tokens_holds_inside_an_accepted_draft(engines: tuple[Engine, Engine],
                                                   limit: int) -> None:
    on, off = engines
    prompt = repeating_prompts(on, 1)[0]
    fast = on.submit(request_for(prompt, greedy(limit, ignore_eos=True))).result(timeout=60)
    slow = off.submit(request_for(prompt, greedy(limit, ignore_eos=True))).result(timeout=60)
    assert fast.finish_reason is FinishReason.LENGTH
    assert len(fast.token_ids) == limit and fast.token_ids == slow.token_ids


def test_a_stop_string_inside_a_draft_ends_the_row_there(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    prompt = repeating_prompts(on, 1)[0]
    text = off.submit(request_for(prompt, greedy(60, ignore_eos=True))).result().text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    fast = on.submit(request_for(prompt, greedy(60, ignore_eos=True, stop=(stop,)))).result()
    slow = off.submit(request_for(prompt, greedy(60, ignore_eos=True, stop=(stop,)))).result()
    assert fast.finish_reason is FinishReason.STOP and fast.text == slow.text
    assert stop not in fast.text


def test_cancelling_a_speculating_row_leaves_its_sibling_unchanged(
        engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    victim_prompt, sibling_prompt = repeating_prompts(on, 2)
    reference = off.submit(request_for(sibling_prompt, greedy(80))).result(timeout=60).token_ids
    for cancel_after in (2, 9):
        seen = [0]
        started = threading.Event()

        def count(_t: int, _d: str, after: int = cancel_after, seen: list[int] = seen,
                  started: threading.Event = started) -> None:
            seen[0] += 1
            if seen[0] >= after:
                started.set()

        victim = on.submit(request_for(victim_prompt, greedy(200, ignore_eos=True)), on_token=count)
        sibling = on.submit(request_for(sibling_prompt, greedy(80)))
        assert started.wait(60)
        victim.cancel()
        assert sibling.result(timeout=60).token_ids == reference
        wait_until(lambda v=victim: v.done)
    wait_until(lambda: on.stats().running == 0)
