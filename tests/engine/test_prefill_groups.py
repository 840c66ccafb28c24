"""The batch lane feeds prefill groups so that no group's first tokens wait on another's
prefill, yet a long prompt in flight does not make short newcomers wait for it.

Each test drives a lane directly on a thread of its own, as the engine does (the thread
that loads the model owns its stream, released at the end); a spy on the generator's
public ``insert_segments`` records when rows reach it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.device.batch_lane import BatchLane
from engine.device.loader import build_lanes, load_model, release_streams
from engine.lane import LaneRow
from engine.prepare import Preparer


class Recorder:
    """The lane under test, and which step each row was fed in and first decoded in."""

    def __init__(self, lane: BatchLane) -> None:
        self.lane = lane
        self.steps = 0
        self.fed_at: dict[int, int] = {}
        self.first_token_at: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        generator = lane.generator
        real_insert = generator.insert_segments
        uids: dict[int, int] = {}

        def spy(segments: Any, **kwargs: Any) -> list[int]:
            new = real_insert(segments, **kwargs)
            for uid in new:
                uids[uid] = self.steps
            return list(new)

        generator.insert_segments = spy  # type: ignore[method-assign]
        self._uids = uids

    def insert(self, rows: list[LaneRow]) -> None:
        self.lane.insert(rows)
        self._note_fed()

    def step(self) -> None:
        self.steps += 1
        result = self.lane.step()
        assert not result.failed
        for token in result.tokens:
            self.first_token_at.setdefault(token.request_id, self.steps)
            self.tokens.setdefault(token.request_id, []).append(token.token)
        self._note_fed()

    def _note_fed(self) -> None:
        for request_id, uid in self.lane._request_to_uid.items():
            self.fed_at.setdefault(request_id, self._uids[uid])


LaneFactory = Callable[..., Recorder]


@pytest.fixture
def on_lane_thread(tiny_model_dir: Path) -> Callable[[Callable[[LaneFactory], None]], None]:
    """Run a test body on its own thread with a factory of recorded lanes."""

    def make(**config: Any) -> Recorder:
        cfg = EngineConfig(prefix_cache_bytes=0, **config)
        loaded = load_model(tiny_model_dir, cfg)
        preparer = Preparer(loaded.tokenizer, tiny_model_dir, loaded.vocab_size, 0)
        return Recorder(build_lanes(loaded, cfg, preparer.compiler).batch)

    def run(body: Callable[[LaneFactory], None]) -> None:
        failure: list[BaseException] = []

        def target() -> None:
            try:
                body(make)
            except BaseException as exc:  # re-raised on the test's thread
                failure.append(exc)
            finally:
                release_streams()

        thread = threading.Thread(target=target)
        thread.start()
        thread.join(120)
        assert not thread.is_alive(), "the lane test did not finish in 120 s"
        if failure:
            raise failure[0]

    return run


def _rows(first_id: int, lengths: list[int], seed: int) -> list[LaneRow]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1000, temperature=0.0)
    return [LaneRow(first_id + i, [rng.randrange(10, 2000) for _ in range(n)], params)
            for i, n in enumerate(lengths)]


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
