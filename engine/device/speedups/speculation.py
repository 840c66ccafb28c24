"""Prompt-lookup speculation for greedy rows while few rows run, on every cache kind.

At low load a batch step is one row's forward, and most of its cost is reading the
weights, not the tokens: checking eight drafted tokens costs little more than decoding
one. A speculating row leaves mlx-lm's generator and is decoded here on its own cache:
each step feeds its last token and a draft (``engine.core.drafts``), keeps the drafted
tokens the model's own greedy choice agrees with plus the model's next token, and takes
the rejected ones back out of its cache. Greedy output is the model's argmax at every
position, as without speculation. A row whose drafts stop being accepted returns to the
generator.

Taking rejected tokens back, by cache kind (``engine.device.rows.row_cache``):

- plain KV and sliding windows are trimmed: a multi-token forward keeps the window the
  last kept token needs, so trimming the rejected keys is exact (``trimmed``);
- state caches (SSM, linear attention, convolutions) cannot forget tokens: the state
  before the forward is kept (``Rollback``, no copy) and restored, and the tokens that
  were right are fed again at the front of the next step's forward (the row's
  ``backlog``), so a rejection costs a few more tokens in one forward, not a forward.

Constrained rows speculate too: the tokens their grammar forces lead the draft, the
prompt-lookup part is cut where the grammar would refuse it (llguidance's
``validate_tokens``), each position's logits are masked as decoding would mask them,
and the matcher is rolled back to what the model accepted.

Rows that ask for logprobs speculate as well: each kept token's logprob is read from the
(masked) logits of the position that chose it, as decoding reads it from its step's; a
forced token's is 0 (``forced_logprob``), as fast-forward reports it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.core.drafts import lookup_draft
from engine.core.lane import LaneRow, RowToken
from engine.device.rows.logprobs import forced_logprob, token_logprobs
from engine.device.rows.row_cache import Rollback, trimmed
from engine.device.rows.sampling import unpack_bitmask
from engine.device.rows.speculating_row import SpeculatingRow
from engine.requests.constraints.grammar import RowGrammar
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.outbound.results import TokenLogprob

# Tokens drafted per check. Measured here (SmolLM2-135M f32, 2 cores): a one-token
# forward ~85 ms, seven tokens ~150 ms, so a check pays from about one accepted token.
DRAFT_TOKENS = 6
# Mean accepted tokens per draft, per row in the lane, below which a check does not pay:
# at one row a check (~150 ms) must bring two tokens to beat a step (~70 ms); a batch of
# B rows steps each row for less, so the bar rises with B.
ACCEPTANCE_FLOOR = 1.2
IDLE_CHECKS = 2  # steps without a draft after which a row goes back to the generator
# Tokens a state-cache row may carry to feed again before it checks no draft for a step
# (which feeds them for good): bounds the extra width of its forwards.
MAX_BACKLOG = 2 * DRAFT_TOKENS


def eligible(row: LaneRow) -> bool:
    """Rows whose next token is the plain (or grammar-masked) argmax: nothing else changes
    the logits (logprobs, when asked for, are read from the same logits)."""
    params = row.params
    return (params.greedy and not params.logits_processors
            and params.repetition_penalty is None)


def speculate(model: Any, spec: SpeculatingRow, budget: int) -> list[RowToken]:
    """One step of one row: feed what it has decided and a draft, keep what the model
    agrees with and the model's own next token (at most ``budget`` tokens in all)."""
    request_id = spec.row.request_id
    params = spec.row.params
    grammar = spec.grammar
    if grammar is not None and grammar.done:
        return []  # its last token completed the grammar: the row ends on it
    forced = _forced(grammar, budget - 1)
    out = [RowToken(request_id, token, forced_logprob(params, token), forced=True,
                    grammar_done=done)
           for token, done in forced]
    if forced and forced[-1][1]:
        return out  # the grammar is complete: the row ends on its last forced token
    span = [token for token, _ in forced]
    room = 0 if len(spec.backlog) >= MAX_BACKLOG else min(DRAFT_TOKENS, budget - 1 - len(span))
    draft = lookup_draft([*spec.history, *spec.unfed, *span], room)
    if grammar is not None and draft:
        draft = draft[:grammar.validate(draft)]
    spec.idle = 0 if draft or span else spec.idle + 1
    fed = [*spec.unfed, *span, *draft]
    checked = len(spec.backlog) + len(span)  # logits from here on choose tokens
    mark = None if spec.trims or not draft else Rollback.of(spec.cache)
    logits = model(mx.array([fed]), cache=spec.cache)[0, checked:]
    scores = _masked(logits, grammar, draft, spec.words)
    choices: list[int] = mx.argmax(scores, axis=-1).tolist()  # type: ignore[assignment]
    accepted = 0
    while accepted < len(draft) and choices[accepted] == draft[accepted]:
        accepted += 1
    if draft or span:
        spec.acceptance.record(accepted + len(span))
    kept = [*draft[:accepted], choices[accepted]]
    done_after = _consume(grammar, kept)
    rejected = len(draft) - accepted
    known = fed[:len(fed) - rejected]  # every fed token that stays true
    if rejected and mark is not None:
        mark.restore(spec.cache)  # the state as before this forward: feed ``known`` again
        spec.backlog = known
    else:
        trimmed(spec.cache, rejected)
        spec.history += known
        spec.backlog = []
    spec.pending = kept[-1]
    logprobs = _logprobs(params, scores, kept)
    return out + [RowToken(request_id, token, logprob, drafted=i < accepted, grammar_done=done)
                  for i, (token, done, logprob) in enumerate(zip(kept, done_after, logprobs))]


def _forced(grammar: RowGrammar | None, limit: int) -> list[tuple[int, bool]]:
    """The tokens the row's grammar forces next, consumed (they are certain), each with
    whether the grammar is complete after it."""
    if grammar is None or limit <= 0:
        return []
    span = []
    for token in grammar.forced(limit):
        grammar.consume(token)
        span.append((token, grammar.done))
    return span


def _masked(logits: mx.array, grammar: RowGrammar | None, draft: list[int],
            words: int) -> mx.array:
    """Each checked position's logits, masked as decoding would mask them (the greedy
    choice is their argmax).

    A constrained row's mask at position ``i`` is its matcher's after the first ``i``
    draft tokens: they are consumed to fill it, then rolled back (the caller consumes
    what was accepted).
    """
    if grammar is None:
        return logits
    bitmask = np.zeros((len(draft) + 1, words), dtype=np.int32)
    mark = grammar.mark()
    for i in range(len(draft) + 1):
        grammar.fill(bitmask, i)  # a complete grammar's mask allows only the end
        if i < len(draft) and not grammar.done:
            grammar.consume(draft[i])
    grammar.rollback(mark)
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    return mx.where(allowed, logits[: len(draft) + 1], -mx.inf)


def _logprobs(params: SamplingParams, scores: mx.array,
              kept: list[int]) -> list[TokenLogprob | None]:
    """The kept tokens' logprobs, each from the position that chose it, normalised as the
    decoding step normalises its logits; None for each when none were asked for."""
    if not params.logprobs:
        return [None] * len(kept)
    rows = scores[: len(kept)]
    normalised = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    return token_logprobs([params] * len(kept), kept, [normalised[i] for i in range(len(kept))])


def _consume(grammar: RowGrammar | None, tokens: list[int]) -> list[bool]:
    """Feed the kept tokens to the matcher; whether it is complete after each."""
    if grammar is None:
        return [False] * len(tokens)
    done = []
    for token in tokens:
        if not grammar.done:  # tokens after completion are dropped where the row ends
            grammar.consume(token)
        done.append(grammar.done)
    return done
