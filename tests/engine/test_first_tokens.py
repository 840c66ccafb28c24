"""A prefill group's first tokens are reported in the step that samples them, one step
before mlx-lm's generator returns them, and nothing is lost or doubled on the way.

The ground truth is mlx-lm's own ``BatchGenerator`` driven directly on the same model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from engine import SamplingParams
from engine.core.lane import LaneRow
from engine.device.rows.first_tokens import SamplerTap

from .lane_recorder import LaneFactory
from .lane_recorder import random_rows as _rows

TOKENS = 10


def _reference(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens per prompt from mlx-lm's generator alone, no lane in between."""
    return _reference_with_logprobs(model, prompts)[0]


def _reference_with_logprobs(model: Any, prompts: list[list[int]]
                             ) -> tuple[list[list[int]], list[float]]:
    """Also each prompt's first token's log-probability, as mlx-lm returns it."""
    generator = BatchGenerator(model, max_tokens=TOKENS, prefill_batch_size=len(prompts))
    uids = generator.insert(prompts)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    first: dict[int, float] = {}
    while any(len(tokens) < TOKENS for tokens in out.values()):
        for response in generator.next_generated():
            out[response.uid].append(response.token)
            first.setdefault(response.uid, response.logprobs[response.token].item())
    return [out[uid] for uid in uids], [first[uid] for uid in uids]


def _decode(rec: Any, rows: list[LaneRow]) -> None:
    while any(len(rec.tokens.get(r.request_id, [])) < TOKENS for r in rows):
        rec.step()
        assert rec.steps < 40


def test_first_tokens_come_in_the_step_that_samples_them(on_lane_thread: Any) -> None:
    on_lane_thread(_first_tokens_early)


def _first_tokens_early(lane_factory: LaneFactory) -> None:
    rec = lane_factory(max_batch=8, prefill_batch=4)
    rows = _rows(1, [12, 9, 15], seed=5)
    rec.insert(rows)
    _decode(rec, rows)
    # Step 1 prefills all but each prompt's last token; step 2 runs the last tokens and
    # samples the first ones. mlx-lm itself returns them from step 3.
    assert {rec.first_token_at[r.request_id] for r in rows} == {2}
    reference = _reference(rec.model, [r.prompt for r in rows])
    assert [rec.tokens[r.request_id][:TOKENS] for r in rows] == reference


def test_a_group_with_mixed_samplers_and_logprobs_reads_each_row(on_lane_thread: Any) -> None:
    on_lane_thread(_mixed_samplers)


def _mixed_samplers(lane_factory: LaneFactory) -> None:
    rec = lane_factory(max_batch=8, prefill_batch=4)
    # top_k=1 samples the argmax: deterministic, yet its own sampler object, so mlx-lm
    # samples this group row by row instead of in one call.
    kinds = [SamplingParams(max_tokens=100, temperature=0.0),
             SamplingParams(max_tokens=100, temperature=0.7, top_k=1),
             SamplingParams(max_tokens=100, temperature=0.0, logprobs=True, top_logprobs=3)]
    rows = [LaneRow(10 + i, row.prompt, params)
            for i, (row, params) in enumerate(zip(_rows(10, [11, 13, 8], seed=6), kinds))]
    logprobs: dict[int, Any] = {}
    real_step = rec.lane.step

    def step() -> Any:
        result = real_step()
        for token in result.tokens:
            logprobs.setdefault(token.request_id, []).append(token.logprob)
        return result

    rec.lane.step = step  # type: ignore[method-assign]
    rec.insert(rows)
    _decode(rec, rows)
    assert {rec.first_token_at[r.request_id] for r in rows} == {2}
    reference, reference_logprobs = _reference_with_logprobs(rec.model,
                                                             [r.prompt for r in rows])
    assert [rec.tokens[r.request_id][:TOKENS] for r in rows] == reference
    first = logprobs[12][0]  # read from the tap: the numbers mlx-lm returns a step later
    assert first is not None and first.token_id == reference[2][0]
    assert abs(first.logprob - reference_logprobs[2]) < 1e-5
    assert first.top[0][0] == first.token_id and len(first.top) == 3
    assert all(lp is not None and lp.logprob <= 0 for lp in logprobs[12])
    assert logprobs[10][0] is None  # not asked for


def test_constrained_rows_get_their_first_token_the_usual_way(on_lane_thread: Any) -> None:
    on_lane_thread(_constrained_row)


def _constrained_row(lane_factory: LaneFactory) -> None:
    from engine import Regex

    rec = lane_factory(max_batch=8, prefill_batch=4)
    plain, = _rows(20, [10], seed=7)
    constrained = LaneRow(21, plain.prompt, SamplingParams(
        max_tokens=100, temperature=0.0, constraint=Regex("[a-z ]{1,40}")))
    rec.insert([plain, constrained])
    while len(rec.first_token_at) < 2:
        rec.step()
    # The grammar learns of its first token only in the following step, so that row's
    # token (and whether the grammar is complete) is reported then, as mlx-lm returns it.
    assert rec.first_token_at[20] == 2
    assert rec.first_token_at[21] == 3


# ----- the tap on its own: it reads only a log it can account for ------------------------

def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def test_tap_reads_the_groups_calls_after_the_decodes_calls() -> None:
    tap = SamplerTap()
    shared, other = tap.wrap(_greedy), tap.wrap(make_sampler(temp=0.5, top_k=1))
    assert tap.wrap(_greedy) is shared  # one wrapper per sampler: mlx-lm still batches
    tap.arm()
    shared(mx.array([[0.0, 1.0, 0.0]] * 3))  # the decode: three rows sharing a sampler
    shared(mx.array([[2.0, 0.0, 0.0]]))  # the group, row by row
    other(mx.array([[0.0, 0.0, 3.0]]))
    firsts = tap.group_tokens([shared, other], decoded=3)
    assert firsts is not None and [f.token for f in firsts] == [0, 2]
    assert firsts[1].logprobs.tolist() == [0.0, 0.0, 3.0]


def test_tap_reads_nothing_it_cannot_account_for() -> None:
    tap = SamplerTap()
    shared, other = tap.wrap(_greedy), tap.wrap(make_sampler(temp=0.5, top_k=1))
    tap.arm()
    shared(mx.array([[0.0, 1.0]] * 2))
    assert tap.group_tokens([shared, shared], decoded=0) is not None
    assert tap.group_tokens([shared, shared, shared], decoded=0) is None  # too few rows
    assert tap.group_tokens([other, other], decoded=0) is None  # another sampler
    assert tap.group_tokens([shared, shared], decoded=1) is None  # a decode unaccounted
    assert tap.group_tokens([], decoded=0) is None
    tap.disarm()
    shared(mx.array([[0.0, 1.0]] * 2))  # not logged once disarmed
    assert tap.group_tokens([shared, shared], decoded=0) is None
