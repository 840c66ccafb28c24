"""engine.core.step_core over a scripted lane: admission, cancellation before and after
prefill, failure containment, deadlines and endings, with no model and no mlx.

The lane holds rows as a real one does and, at each step, gives every row it holds its next
scripted token (a row's prompt picks its script); the preparer is a stand-in with the
methods the core calls. What is under test is the core's own work: which rows reach the
lane and when, what leaves it, and how each row's stream ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from engine.core.footprint import LayerFootprint, ModelFootprint
from engine.core.lane import LaneCapabilities, LaneKind, LaneRow, LaneStep, RowToken
from engine.core.rows import RequestStatus, Row
from engine.core.scheduler import Scheduler
from engine.core.stats import StatsBook
from engine.core.step_core import StepCore
from engine.core.streams import RequestHandle, RequestStream
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, RequestTimeoutError
from engine.requests.inbound.prompts import PromptImage
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.inbound.text_request import Request, TextRequest
from engine.requests.outbound.channels import ChannelSplitter
from engine.requests.outbound.results import Completion, FinishReason
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText
from engine.requests.prepare import PreparedRequest

EOS = 0
FOOTPRINT = ModelFootprint.of([LayerFootprint("KVCache", True, bytes_per_token=10)], 1000)


class LetterDetokenizer:
    """Token t is the letter chr(ord('a') + t % 26)."""

    def __init__(self) -> None:
        self._pending = ""

    def add_token(self, token: int) -> None:
        self._pending += chr(ord("a") + token % 26)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass
class ScriptedPreparer:
    """The methods ``StepCore`` calls; a prompt whose first id is 999 cannot be prepared."""

    live_matchers: int = 0

    @property
    def compiler(self) -> ScriptedPreparer:
        return self

    def prepare(self, request: Request) -> PreparedRequest:
        assert isinstance(request, TextRequest)
        ids = list(request.prompt)  # type: ignore[arg-type]
        if ids[0] == 999:
            raise ValueError("prompt token ids out of range [0, 100): [999]")
        return PreparedRequest(ids, request.params, frozenset({EOS}))

    def row_text(self, params: SamplingParams) -> RowText:
        return RowText(LetterDetokenizer(), params.stop)

    def row_channels(self, request: Request, prepared: PreparedRequest) -> RowChannels:
        return RowChannels(ChannelSplitter({}), None, ())


@dataclass
class ScriptedLane:
    """Each row decodes its prompt's last id + 1, + 2, ...; a prompt ending in 0 writes EOS
    at its third token. ``fail_rows`` fail with their own error at the next step;
    ``fault`` makes the next step raise as a failed model step would."""

    inserted: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    steps: int = 0
    fault: BaseException | None = None
    fail_rows: dict[int, BaseException] = field(default_factory=dict)
    refuses: dict[int, str] = field(default_factory=dict)  # a prompt's last id -> why
    _rows: dict[int, list[int]] = field(default_factory=dict)  # request id -> tokens so far
    _starts: dict[int, int] = field(default_factory=dict)

    def accepts(self, row: LaneRow) -> str | None:
        return self.refuses.get(row.prompt[-1])

    def insert(self, rows: Sequence[LaneRow]) -> None:
        for row in rows:
            self.inserted.append(row.request_id)
            self._rows[row.request_id] = []
            self._starts[row.request_id] = row.prompt[-1]

    def remove(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            self.removed.append(request_id)
            self._rows.pop(request_id, None)

    def step(self) -> LaneStep:
        self.steps += 1
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        step = LaneStep(width=len(self._rows))
        for request_id, tokens in self._rows.items():
            if request_id in self.fail_rows:
                step.failed[request_id] = self.fail_rows.pop(request_id)
                continue
            start = self._starts[request_id]
            token = EOS if start == 0 and len(tokens) == 2 else start + len(tokens) + 1
            tokens.append(token)
            step.tokens.append(RowToken(request_id, token))
        return step

    def reset(self) -> list[int]:
        dropped = list(self._rows)
        self._rows.clear()
        return dropped

    def held(self) -> list[int]:
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class Core:
    """A step core over one scripted batch lane (and an idle serial lane)."""

    max_batch: int = 2
    max_failures: int = 3
    lane: ScriptedLane = field(default_factory=ScriptedLane)
    serial: ScriptedLane = field(default_factory=ScriptedLane)
    book: StatsBook = field(default_factory=StatsBook)
    core: StepCore = field(init=False)
    _ids: int = 0

    def __post_init__(self) -> None:
        scheduler = Scheduler(FOOTPRINT, self.max_batch, None)
        lanes = {LaneKind.BATCH: self.lane, LaneKind.SERIAL: self.serial}
        self.core = StepCore(scheduler, lanes.__getitem__, ScriptedPreparer(),  # type: ignore[arg-type]
                             self.book, prefix_bytes=lambda: 0,
                             max_consecutive_failures=self.max_failures)

    def submit(self, prompt: list[int], max_tokens: int = 4,
               deadline: float | None = None) -> RequestHandle:
        self._ids += 1
        stream = RequestStream()
        row = Row(self._ids, TextRequest(prompt, SamplingParams(max_tokens=max_tokens)),
                  stream, None, 0.0, deadline)
        self.core.accept(row)
        return RequestHandle(self._ids, stream, lambda rid=self._ids: self.core.cancel(rid))

    def turns(self, n: int) -> None:
        for _ in range(n):
            self.core.turn()


def result(handle: RequestHandle) -> Completion:
    return handle.result(timeout=1)


def test_rows_are_admitted_fifo_up_to_max_batch_and_the_next_joins_as_one_ends() -> None:
    c = Core(max_batch=2)
    first, second, third = c.submit([1], 2), c.submit([10], 5), c.submit([20], 2)
    c.turns(1)
    assert c.lane.inserted == [1, 2] and c.core.rows[3].status is RequestStatus.WAITING
    c.turns(1)  # the first row reaches max_tokens=2: its room goes to the third
    assert result(first).finish_reason is FinishReason.LENGTH
    assert result(first).token_ids == (2, 3) and result(first).text == "cd"
    c.turns(1)
    assert c.lane.inserted == [1, 2, 3]
    c.turns(3)
    assert result(second).token_ids == (11, 12, 13, 14, 15)
    assert result(third).token_ids == (21, 22)
    assert c.lane.removed == [1, 3, 2]  # every row that ended left the lane
    assert not c.core.rows and len(c.lane) == 0
    stats = c.book.snapshot()
    assert stats.completed == 3 and stats.peak_running == 2


def test_a_row_its_lane_cannot_run_fails_alone_by_name_and_never_starts() -> None:
    alone = Core()
    expected = alone.submit([40], 3)
    alone.turns(3)
    c = Core()
    c.lane.refuses[77] = "this model reads no images"
    refused, sibling = c.submit([77], 3), c.submit([40], 3)
    c.turns(3)
    with pytest.raises(InvalidRequestError, match="this model reads no images"):
        result(refused)
    assert c.lane.inserted == [2] and 1 not in c.core.rows
    assert result(sibling).token_ids == result(expected).token_ids


def test_lane_capabilities_name_what_the_model_cannot_take() -> None:
    text = LaneRow(1, [1, 2], SamplingParams())
    image = replace(text, images=(PromptImage(0, 1, "k", lambda: None),))
    adapter = replace(text, params=SamplingParams(adapter="/a"))
    plain = LaneCapabilities()
    assert plain.refusal(text) is None
    assert plain.refusal(image) == "this model reads no images"
    assert "serves no adapters" in (plain.refusal(adapter) or "")
    both = LaneCapabilities(images=True, adapters=True)
    assert both.refusal(image) is None and both.refusal(adapter) is None


def test_a_stop_token_ends_the_row_with_stop_and_is_not_in_its_text() -> None:
    c = Core()
    handle = c.submit([0], 10)
    c.turns(3)
    done = result(handle)
    assert done.finish_reason is FinishReason.STOP
    assert done.token_ids == (1, 2) and done.text == "bc"


def test_cancel_before_prefill_never_reaches_the_lane() -> None:
    c = Core(max_batch=1)
    running, waiting = c.submit([1], 6), c.submit([30], 6)
    c.turns(1)
    waiting.cancel()
    c.turns(1)
    assert result(waiting).finish_reason is FinishReason.CANCELLED
    assert 2 not in c.lane.inserted and 2 not in c.lane.removed
    c.turns(5)
    assert result(running).token_ids == (2, 3, 4, 5, 6, 7)  # as if it had been alone


def test_cancel_after_prefill_evicts_the_row_and_leaves_siblings_unchanged() -> None:
    alone = Core()
    expected = alone.submit([40], 5)
    alone.turns(5)
    c = Core()
    victim, sibling = c.submit([1], 50), c.submit([40], 5)
    c.turns(2)
    victim.cancel()
    c.turns(1)
    assert result(victim).finish_reason is FinishReason.CANCELLED
    assert result(victim).token_ids == (2, 3)  # what it had made before the cancel
    assert c.lane.removed[0] == 1 and 1 not in c.lane.held()
    c.turns(2)
    assert result(sibling).token_ids == result(expected).token_ids


def test_a_request_that_cannot_be_prepared_fails_alone() -> None:
    c = Core()
    bad, good = c.submit([999]), c.submit([5], 3)
    with pytest.raises(ValueError, match="out of range"):
        result(bad)
    c.turns(3)
    assert result(good).token_ids == (6, 7, 8)
    assert 1 not in c.lane.inserted and c.book.snapshot().failed == 1


def test_a_rows_own_failure_ends_it_alone() -> None:
    c = Core()
    broken, fine = c.submit([1], 6), c.submit([50], 3)
    c.turns(1)
    c.lane.fail_rows[1] = RuntimeError("its processor broke")
    c.turns(2)
    with pytest.raises(RuntimeError, match="processor broke"):
        result(broken)
    assert 1 in c.lane.removed
    c.turns(1)
    assert result(fine).token_ids == (51, 52, 53)


def test_a_failed_model_step_fails_the_lanes_rows_and_the_core_recovers() -> None:
    c = Core(max_batch=2)
    in_flight = [c.submit([1], 9), c.submit([2], 9)]
    later = c.submit([60], 2)  # waiting: not in the lane when the step fails
    c.turns(1)
    fault = RuntimeError("device lost")
    c.lane.fault = fault
    c.turns(1)
    for handle in in_flight:
        with pytest.raises(EngineError) as info:
            result(handle)
        assert info.value.__cause__ is fault and not isinstance(info.value, EngineDeadError)
    c.turns(2)
    assert result(later).token_ids == (61, 62)


def test_consecutive_failed_steps_up_to_the_limit_kill_the_core() -> None:
    c = Core(max_failures=2)
    c.submit([1], 9)
    c.turns(1)
    c.lane.fault = RuntimeError("first")
    c.turns(1)
    c.submit([2], 9)  # admitted and stepped in the next turn, whose step fails again
    c.lane.fault = RuntimeError("second")
    with pytest.raises(EngineDeadError, match="2 model steps failed"):
        c.turns(1)


def test_a_passed_deadline_cancels_the_row_with_a_timeout_error() -> None:
    c = Core()
    timed, other = c.submit([1], 9, deadline=0.0), c.submit([70], 2)
    c.turns(1)
    with pytest.raises(RequestTimeoutError, match="timed out"):
        result(timed)
    c.turns(2)
    assert result(other).token_ids == (71, 72)


def test_fail_rows_ends_everything_the_core_holds() -> None:
    c = Core(max_batch=1)
    running, waiting = c.submit([1], 9), c.submit([2], 9)
    c.turns(1)
    c.core.fail_rows(EngineDeadError("going away"), FinishReason.ERROR)
    for handle in (running, waiting):
        with pytest.raises(EngineDeadError):
            result(handle)
    assert not c.core.rows and c.core.scheduler.is_idle()


def test_rows_ended_since_the_last_collection_are_flagged() -> None:
    c = Core()
    c.submit([1], 1)
    assert not c.core.ended_since_collect
    c.turns(1)
    assert c.core.ended_since_collect


def test_the_turn_steps_only_lanes_that_hold_rows() -> None:
    c = Core()
    c.turns(2)
    assert c.lane.steps == 0 and c.serial.steps == 0
    c.submit([1], 1)
    c.turns(1)
    assert c.lane.steps == 1 and c.serial.steps == 0
