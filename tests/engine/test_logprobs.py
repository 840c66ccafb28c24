"""Logprobs through every way a token is made: decoded in the batch, forced by a grammar
(fast-forward on or off), confirmed in a speculative check. Each way gives the chosen
token's log-probability and its alternatives from the distribution it was chosen from, so
the same request reports the same numbers (to float tolerance) however it ran."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

import engine.device.batch_lane as batch_lane
from engine import Completion, Engine, JsonSchema, SamplingParams, TokenLogprob
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
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "every-draft-checked":  # whatever its record: most drafts are then rejected
        monkeypatch.setattr(batch_lane, "ACCEPTANCE_FLOOR", 0.0)
    on = make_engine(max_batch=16, prefill_chunk=64, speculation=4)
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
