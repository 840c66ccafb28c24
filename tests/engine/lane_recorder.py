"""Driving a batch lane directly, on a thread of its own as the engine does (the thread
that loads the model owns its stream, released at the end): a recorder of which step each
row was fed in and first decoded in, and the fixture that runs a test body on that thread.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.core.lane import LaneRow
from engine.device.lane.batch_lane import BatchLane
from engine.device.loading.loader import build_lanes, load_model, release_streams
from engine.requests.prepare import Preparer


class Recorder:
    """The lane under test, and which step each row was fed in and first decoded in."""

    def __init__(self, lane: BatchLane, model: Any) -> None:
        self.lane = lane
        self.model = model  # the loaded mlx-lm model the lane runs
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

    def accepts(self, row: LaneRow) -> str | None:
        return self.lane.accepts(row)  # type: ignore[no-any-return]

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
        for row in self.lane.rows.in_generator():
            assert row.uid is not None
            self.fed_at.setdefault(row.request_id, self._uids[row.uid])


LaneFactory = Callable[..., Recorder]


@pytest.fixture
def on_lane_thread(tiny_model_dir: Path) -> Callable[[Callable[[LaneFactory], None]], None]:
    """Run a test body on its own thread with a factory of recorded lanes."""

    def make(**config: Any) -> Recorder:
        cfg = EngineConfig(prefix_cache_bytes=0, **config)
        loaded = load_model(tiny_model_dir, cfg)
        preparer = Preparer(loaded.tokenizer, tiny_model_dir, loaded.vocab_size, 0)
        return Recorder(build_lanes(loaded, cfg, preparer.compiler).batch, loaded.model)

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


def random_rows(first_id: int, lengths: list[int], seed: int) -> list[LaneRow]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1000, temperature=0.0)
    return [LaneRow(first_id + i, [rng.randrange(10, 2000) for _ in range(n)], params)
            for i, n in enumerate(lengths)]
