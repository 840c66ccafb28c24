"""Logprobs through every way a token is made: decoded in the batch, forced by a grammar
(fast-forward on or off), confirmed in a speculative check. Each way gives the chosen
token's log-probability and its alternatives from the distribution it was chosen from, so
the same request reports the same numbers (to float tolerance) however it ran."""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import pytest

from engine import Completion, Engine, JsonSchema, SamplingParams, StepProbe, TokenLogprob
from engine.device.rows.logprobs import token_logprobs
from testkit.speculating import every_draft_checked
from tests.conftest import greedy, prompts_of_lengths, request_for

TOLERANCE = 1e-4  # a multi-token forward sums in another order than a one-token step
SHAPE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "size": {"enum": ["small", "large"]}},
         "required": ["name", "size"], "additionalProperties": False}


def close(a: tuple[TokenLogprob, ...] | None, b: tuple[TokenLogprob, ...] | None) -> None:
    """Same tokens, same alternatives in the same order, numbers within TOLERANCE."""
    assert a is not None and b is not None and len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=TOLERANCE)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=TOLERANCE)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "mlx"])
def test_a_steps_rows_are_read_together_on_either_path(on_host: bool) -> None:
    mx.random.seed(3)
    logits = mx.random.normal((4, 5000))
    logits = mx.where(mx.arange(5000) < 4997, logits, 9.0)  # three tied at the top
    masked = mx.where(mx.arange(5000) % 2 == 0, logits, -mx.inf)  # a grammar's mask
    rows = [row - mx.logsumexp(row) for row in (*logits[:3], masked[3])]
    asks = [SamplingParams(logprobs=True, top_logprobs=k) for k in (0, 5, 20)]
    params = [asks[0], asks[1], SamplingParams(), asks[2]]  # the third did not ask
    tokens = [7, 4998, 8, 4996]
    out = token_logprobs(params, tokens, rows, on_host=on_host)
    assert out[2] is None
    for i in (0, 1, 3):
        got = out[i]
        assert got is not None and got.token_id == tokens[i]
        assert got.logprob == pytest.approx(rows[i][tokens[i]].item(), abs=1e-6)
    assert out[0] is not None and out[0].top == ()
    # Most likely first; tied ones by token id, so every path lists them alike.
    assert out[1] is not None and [t for t, _ in out[1].top][:3] == [4997, 4998, 4999]
    assert len(out[1].top) == 5
    masked_top = out[3].top if out[3] is not None else ()
    assert masked_top[0][0] == 4998  # the one tied top token the mask allows
    assert len(masked_top) == 20 and all(t % 2 == 0 and math.isfinite(v) for t, v in masked_top)
    values = [v for _, v in masked_top]
    assert values == sorted(values, reverse=True)
    # The other path gives the same numbers; a bfloat16 row is read as well.
    assert token_logprobs(params, tokens, rows, on_host=not on_host) == out
    half = token_logprobs([asks[1]], [4998], [rows[1].astype(mx.bfloat16)], on_host=on_host)[0]
    assert half is not None and [t for t, _ in half.top][:3] == [4997, 4998, 4999]


def run(eng: Engine, prompt: object, params: SamplingParams) -> Completion:
    return eng.submit(request_for(prompt, params)).result(timeout=120)


def test_a_constrained_rows_alternatives_are_tokens_its_grammar_allowed(
        make_engine: Callable[..., Engine]) -> None:
    stepped = make_engine(max_batch=4, prefill_chunk=64, fast_forward=False, speculation=0)
    forwarded = make_engine(max_batch=4, prefill_chunk=64, speculation=0)
    params = greedy(60, constraint=JsonSchema(SHAPE), logprobs=True, top_logprobs=5)
    slow, fast = run(stepped, "a shape", params), run(forwarded, "a shape", params)
    assert slow.token_ids == fast.token_ids and forwarded.stats().forced_tokens > 0
    assert slow.logprobs is not None and len(slow.logprobs) == len(slow.token_ids)
    for token in slow.logprobs:
        # A refused token (-inf) is no alternative, and no number JSON can carry.
        assert all(math.isfinite(value) for _, value in token.top)
        assert token.top[0][0] == token.token_id  # greedy: the chosen one leads
    forced = [t for t in slow.logprobs if len(t.top) == 1]
    assert forced and all(t.logprob == pytest.approx(0.0, abs=TOLERANCE) for t in forced)
    close(slow.logprobs, fast.logprobs)  # a forced token reads 0 whether fed or decoded


ITEMS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
         "minItems": 20, "maxItems": 20}  # a list that repeats: its drafts are taken


@pytest.mark.parametrize("kind", ["plain", "json-schema", "every-draft-checked"])
def test_speculated_rows_report_the_logprobs_of_decoding(
        make_engine: Callable[..., Engine], kind: str) -> None:
    # Every draft checked, whatever its record: most drafts are then rejected.
    probe = (StepProbe(on_lanes=every_draft_checked()) if kind == "every-draft-checked"
             else None)
    on = make_engine(max_batch=16, prefill_chunk=64, speculation=4, probe=probe)
    off = make_engine(max_batch=16, prefill_chunk=64, speculation=0)
    if kind == "json-schema":
        prompts: list[object] = ["list", "pick some", "names:"]
        params = greedy(120, logprobs=True, top_logprobs=3, constraint=JsonSchema(ITEMS))
    else:  # one token said sixteen times: the tiny model goes on repeating it
        prompts = [[token] * 16 for token in prompts_of_lengths(on, [4], seed=1)[0]]
        params = greedy(60, logprobs=True, top_logprobs=3)
    for prompt in prompts:
        fast, slow = run(on, prompt, params), run(off, prompt, params)
        assert fast.token_ids == slow.token_ids
        close(fast.logprobs, slow.logprobs)
    assert on.stats().drafted_tokens > 0 and off.stats().drafted_tokens == 0
