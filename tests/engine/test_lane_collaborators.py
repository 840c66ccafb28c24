"""The batch lane's collaborators through their seams, with no model: the row records and
the speculator, given a recording ``RowSeam`` and a check of the test's own.

Whole-engine behaviour (the same tokens with every speed-up on or off) is tested in
test_speculation.py, test_fast_forward.py and test_cache_kinds.py; here, what each
collaborator asks of the seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.core.drafts import Acceptance, ShadowDraft
from engine.core.lane import LaneRow, LaneStep, RowToken
from engine.device.rows.batch_row import BatchRow, BatchRows, OutRow
from engine.device.rows.speculating_row import SpeculatingRow
from engine.device.speedups.speculator import SpeculationPolicy, Speculator
from tests.conftest import greedy


@dataclass
class RecordingSeam:
    """A ``RowSeam`` over no generator: rows taken out and put back are recorded."""

    decoding_rows: set[int] = field(default_factory=set)
    taken: list[int] = field(default_factory=list)
    put: list[OutRow] = field(default_factory=list)

    def take_out(self, rows: Sequence[BatchRow]) -> list[OutRow]:
        self.taken += [row.request_id for row in rows]
        for row in rows:
            row.uid = None
        return [OutRow(row, [], list(row.prompt)) for row in rows]

    def put_back(self, rows: Sequence[OutRow]) -> None:
        self.put += rows

    def decoding(self, row: BatchRow) -> bool:
        return row.request_id in self.decoding_rows

    def next_inputs(self, rows: Sequence[BatchRow]) -> list[tuple[int, Any]]:
        raise AssertionError("trimming caches never ask for the next input")


def lane_rows(count: int) -> BatchRows:
    rows = BatchRows()
    for i in range(count):
        row = BatchRow(LaneRow(i, [5, 6, 7, 5, 6, 7, 5, 6], greedy(40)))
        rows.add(row)
        rows.joined(row, 100 + i)
    return rows


def speculator(seam: RecordingSeam, *, limit: int = 2, check: Any = None,
               floor: float = 0.0) -> Speculator:
    return Speculator(None, mx.default_stream(mx.default_device()), seam, words=0, limit=limit,
                      trims=True,
                      policy=SpeculationPolicy(acceptance_floor=floor),
                      check=check or (lambda _model, _spec, _budget: []))


def speculating(row: BatchRow, unfed: list[int]) -> None:
    """Make ``row`` one that speculates, with ``unfed`` decided but not in its cache."""
    row.uid = None
    row.speculating = SpeculatingRow(row.row, [], list(row.prompt), unfed[-1], Acceptance(),
                                     backlog=unfed[:-1])


def test_forgetting_a_row_drops_its_record_and_its_uid() -> None:
    rows = lane_rows(3)
    assert rows.of_uid(101) is rows[1]
    assert rows.forget(1) is not None
    assert rows.of_uid(101) is None and rows.get(1) is None and len(rows) == 2
    assert [row.request_id for row in rows.in_generator()] == [0, 2]
    assert rows.left(rows[2]) == 102 and rows[2].uid is None
    assert [row.request_id for row in rows.in_generator()] == [0]


def test_rows_go_back_through_the_seam_with_what_they_have_not_fed_when_load_rises() -> None:
    rows, seam = lane_rows(3), RecordingSeam()
    speculating(rows[0], [9, 8, 4])
    speculator(seam, limit=2).run(rows, [], LaneStep())
    assert [(out.row.request_id, out.unfed) for out in seam.put] == [(0, [9, 8, 4])]
    assert rows[0].speculating is None and seam.taken == []


def test_a_row_whose_drafts_pay_leaves_through_the_seam_and_is_checked() -> None:
    rows, seam = lane_rows(2), RecordingSeam(decoding_rows={1})
    checked: list[tuple[int, int]] = []

    def check(_model: Any, spec: SpeculatingRow, budget: int) -> list[RowToken]:
        checked.append((spec.row.request_id, budget))
        spec.acceptance.record(3)  # the drafts pay: it stays
        return [RowToken(spec.row.request_id, 7, drafted=True)]

    row = rows[1]
    row.output = [5, 6]
    row.shadow = ShadowDraft(4)
    result = LaneStep()
    speculator(seam, check=check).run(rows, [row], result)
    assert seam.taken == [1] and seam.put == []
    assert row.speculating is not None and row.speculating.pending == 6  # fed again
    assert checked == [(1, 40 - 2)] and row.output == [5, 6, 7]
    assert [t.token for t in result.tokens] == [7] and result.width == 1
