"""Prompt-lookup speculation for greedy rows while few rows run.

At low load a batch step is one row's forward, and most of its cost is reading the
weights, not the tokens: checking eight drafted tokens costs little more than decoding
one. A speculating row leaves mlx-lm's generator and is decoded here on its own KV cache:
each step feeds its last token and a draft (``engine.core.drafts``), keeps the drafted tokens
the model's own greedy choice agrees with plus the model's next token, and trims the
rejected ones from its cache. Greedy output is the model's argmax at every position,
as without speculation. A row whose drafts stop being accepted returns to the generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.core.drafts import Acceptance, lookup_draft
from engine.core.lane import LaneRow, RowToken

# Tokens drafted per check. Measured here (SmolLM2-135M f32, 2 cores): a one-token
# forward ~85 ms, seven tokens ~150 ms, so a check pays from about one accepted token.
DRAFT_TOKENS = 6
# Mean accepted tokens per draft, per row in the lane, below which a check does not pay:
# at one row a check (~150 ms) must bring two tokens to beat a step (~70 ms); a batch of
# B rows steps each row for less, so the bar rises with B.
ACCEPTANCE_FLOOR = 1.2
IDLE_CHECKS = 2  # steps without a draft after which a row goes back to the generator


@dataclass
class SpeculatingRow:
    """A row decoded outside the generator: its cache and the token not yet fed."""

    row: LaneRow
    cache: list[Any]
    history: list[int]  # the tokens its cache holds
    pending: int  # the last token, decided but not yet fed
    acceptance: Acceptance
    idle: int = 0  # consecutive steps without a draft


def eligible(row: LaneRow) -> bool:
    """Rows whose next token is the plain argmax: nothing else changes the logits."""
    params = row.params
    return (params.greedy and params.constraint is None and not params.logits_processors
            and params.repetition_penalty is None and not params.logprobs)


def speculate(model: Any, spec: SpeculatingRow, budget: int) -> list[RowToken]:
    """One step of one row: feed its last token and a draft, keep what the model agrees
    with and the model's own next token (at most ``budget`` tokens in all)."""
    draft = lookup_draft([*spec.history, spec.pending], min(DRAFT_TOKENS, budget - 1))
    spec.idle = 0 if draft else spec.idle + 1
    fed = [spec.pending, *draft]
    logits = model(mx.array([fed]), cache=spec.cache)
    choices: list[int] = mx.argmax(logits[0], axis=-1).tolist()  # type: ignore[assignment]
    accepted = 0
    while accepted < len(draft) and choices[accepted] == draft[accepted]:
        accepted += 1
    if draft:
        spec.acceptance.record(accepted)
    rejected = len(draft) - accepted
    if rejected:
        for layer in spec.cache:
            layer.trim(rejected)
    kept = [*draft[:accepted], choices[accepted]]
    spec.history += fed[:1 + accepted]
    spec.pending = kept[-1]
    request_id = spec.row.request_id
    return [RowToken(request_id, token, drafted=i < accepted) for i, token in enumerate(kept)]
