"""The batch lane feeds prefill groups so that no group's first tokens wait on another's
prefill, yet a long prompt in flight does not make short newcomers wait for it.

Each test drives a lane directly on a thread of its own, as the engine does (the thread
that loads the model owns its stream, released at the end); a spy on the generator's
public ``insert_segments`` records when rows reach it.
"""

from __future__ import annotations

from typing import Any

from .lane_recorder import LaneFactory
from .lane_recorder import random_rows as _rows


def test_next_group_is_fed_only_after_the_group_ahead_has_its_first_tokens(
        on_lane_thread: Any) -> None:
    on_lane_thread(_next_group_waits)


def _next_group_waits(lane_factory: LaneFactory) -> None:
    rec = lane_factory(max_batch=8, prefill_batch=2)
    rec.insert(_rows(1, [12, 14, 13, 15], seed=1))
    while len(rec.first_token_at) < 4:
        rec.step()
        assert rec.steps < 20
    group_a, group_b = (1, 2), (3, 4)
    assert {rec.fed_at[r] for r in group_a} == {0}  # fed at insert
    a_first = {rec.first_token_at[r] for r in group_a}
    assert len(a_first) == 1
    # B reached the generator in the very step whose results held A's first tokens (after
    # them), not earlier, where its prefill would have delayed them.
    assert {rec.fed_at[r] for r in group_b} == a_first
    assert min(rec.first_token_at[r] for r in group_b) > a_first.pop()


def test_short_rows_join_while_a_long_prompt_is_still_chunks_from_its_end(
        on_lane_thread: Any) -> None:
    on_lane_thread(_short_rows_join)


def _short_rows_join(lane_factory: LaneFactory) -> None:
    rec = lane_factory(max_batch=8, prefill_batch=4, prefill_chunk=8)
    rec.insert(_rows(1, [64], seed=2))  # eight chunks of eight
    rec.step()
    rec.insert(_rows(2, [6, 7], seed=3))
    while len(rec.first_token_at) < 3:
        rec.step()
        assert rec.steps < 40
    assert rec.fed_at[2] == rec.fed_at[3] == 1  # at once: the long row was far from its end
    assert max(rec.first_token_at[2], rec.first_token_at[3]) < rec.first_token_at[1]


def test_rows_fed_in_groups_decode_as_they_would_alone(on_lane_thread: Any) -> None:
    on_lane_thread(_grouped_equals_alone)


def _grouped_equals_alone(lane_factory: LaneFactory) -> None:
    grouped = lane_factory(max_batch=8, prefill_batch=2)
    rows = _rows(1, [9, 17, 12, 20, 11], seed=4)
    grouped.insert(rows)
    while any(len(grouped.tokens.get(r.request_id, [])) < 12 for r in rows):
        grouped.step()
    for row in rows:
        alone = lane_factory(max_batch=1, prefill_batch=1)
        alone.insert([row])
        while len(alone.tokens.get(row.request_id, [])) < 12:
            alone.step()
        assert grouped.tokens[row.request_id][:12] == alone.tokens[row.request_id][:12]
