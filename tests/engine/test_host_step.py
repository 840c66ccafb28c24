"""A decode step's host work: constrained rows masked together while the forward runs, and
one wait on the device a step, as mlx-lm's own generator makes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest

from engine import Engine, FinishReason, StepProbe, TextRequest
from engine.device.rows.grammar_step import GrammarProcessor
from engine.device.upstream.batches import LaneGenerationBatch
from engine.requests.inbound.output_constraint import JsonSchema
from tests.conftest import alone, greedy, prompts_of_lengths, request_for

# Cannot complete within the budget: the constrained rows decode every step.
LONG_LIST = {"type": "array", "minItems": 200, "items": {"type": "string", "maxLength": 24}}
TOKENS = 24


class StepSyncs:
    """Per lane step: how many times the engine thread waited on the device (``mx.eval``, a
    row's own grammar processor) and how many rows the step decoded."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.lanes: Any = None
        self._in_step: int | None = None

    def hand_in(self, lanes: Any) -> None:
        """``StepProbe.on_lanes``: wraps the batch lane's step."""
        self.lanes = lanes
        step = lanes.batch.step

        def counted() -> Any:
            self._in_step = 0
            try:
                result = step()
            finally:
                count, self._in_step = self._in_step, None
            self.steps.append((count or 0, result.width))
            return result

        lanes.batch.step = counted

    def eval_counter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._in_step is not None:
                self._in_step += 1
            return original(*args, **kwargs)

        return counted

    def steady(self, width: int) -> list[int]:
        """The sync counts of the steps that decoded ``width`` rows between two others that
        did (no row joining, prefilling or leaving around them)."""
        return [self.steps[i][0] for i in range(1, len(self.steps) - 1)
                if all(w == width for _, w in self.steps[i - 1:i + 2])]


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepSyncs]:
    counter = StepSyncs()
    monkeypatch.setattr(mx, "eval", counter.eval_counter(mx.eval))
    # A constrained row's own processor reads its last token (``.item()``): a wait too.
    monkeypatch.setattr(GrammarProcessor, "__call__",
                        counter.eval_counter(GrammarProcessor.__call__))
    yield counter


@pytest.fixture
def per_row_calls(monkeypatch: pytest.MonkeyPatch, syncs: StepSyncs) -> dict[int, int]:
    """Calls of a constrained row's own processor (mlx-lm's per-row path), by row slot."""
    calls: dict[int, int] = {}
    original = GrammarProcessor.__call__

    def counted(self: GrammarProcessor, tokens: mx.array, logits: mx.array) -> mx.array:
        calls[id(self.slot)] = calls.get(id(self.slot), 0) + 1
        return original(self, tokens, logits)

    monkeypatch.setattr(GrammarProcessor, "__call__", counted)
    return calls


def _mixed(eng: Engine, plain: list[list[int]]) -> tuple[list[Any], list[Any]]:
    constrained = [eng.submit(TextRequest(f"list {i}", greedy(TOKENS, ignore_eos=True,
                                                              constraint=JsonSchema(LONG_LIST))))
                   for i in range(2)]
    handles = [eng.submit(request_for(p, greedy(TOKENS, ignore_eos=True))) for p in plain]
    return constrained, handles


def test_constrained_rows_are_masked_together_and_plain_rows_keep_their_tokens(
        make_engine: Callable[..., Engine], syncs: StepSyncs,
        per_row_calls: dict[int, int]) -> None:
    eng = make_engine(max_batch=8, prefill_batch=8, probe=StepProbe(on_lanes=syncs.hand_in))
    plain = prompts_of_lengths(eng, [7, 19], seed=5)
    reference = alone(eng, plain, greedy(TOKENS, ignore_eos=True))
    lists = [eng.submit(TextRequest(f"list {i}", greedy(TOKENS, ignore_eos=True,
                                                        constraint=JsonSchema(LONG_LIST))))
             .result(timeout=60).token_ids for i in range(2)]
    per_row_calls.clear()
    constrained, handles = _mixed(eng, plain)
    assert [h.result(timeout=60).token_ids for h in handles] == reference
    for handle, before in zip(constrained, lists):
        result = handle.result(timeout=60)
        assert result.finish_reason is FinishReason.LENGTH
        assert result.text.startswith("[") and result.token_ids == before
    batch = syncs.lanes.batch.generator._generation_batch
    assert isinstance(batch, LaneGenerationBatch) and batch.steps_masked >= TOKENS - 2
    # mlx-lm ran a constrained row's own processor in its group's first step alone.
    assert len(per_row_calls) == 2 and max(per_row_calls.values()) <= 1


def test_one_wait_on_the_device_a_decode_step(make_engine: Callable[..., Engine],
                                               syncs: StepSyncs) -> None:
    eng = make_engine(max_batch=8, prefill_batch=8, probe=StepProbe(on_lanes=syncs.hand_in))
    plain = prompts_of_lengths(eng, [7, 19], seed=6)
    constrained, handles = _mixed(eng, plain)
    for handle in constrained + handles:
        handle.result(timeout=60)
    steady = syncs.steady(width=4)
    assert len(steady) >= TOKENS // 2, syncs.steps
    assert steady == [1] * len(steady), syncs.steps
