"""A sampled token's log-probability and the most likely alternatives, as plain numbers."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from engine.requests.inbound.sampling import SamplingParams
from engine.requests.outbound.results import TokenLogprob


def token_logprob(params: SamplingParams, token: int, logprobs: Any) -> TokenLogprob | None:
    """``None`` unless the row asked for logprobs (this reads device memory)."""
    if not params.logprobs or logprobs is None:
        return None
    row = logprobs.reshape(-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = params.top_logprobs
        ids = mx.argpartition(-row, k - 1)[:k]
        values = row[ids]
        order = mx.argsort(-values)
        top_ids: list[int] = ids[order].tolist()  # type: ignore[assignment]
        top_values: list[float] = values[order].tolist()
        # Tokens a grammar's mask refused (-inf) were never alternatives: a constrained
        # row lists only what it could have written (a forced token alone, as
        # ``forced_logprob`` does), and -inf is no number JSON can carry.
        top = tuple((tid, value) for tid, value in zip(top_ids, top_values)
                    if value != -math.inf)
    return TokenLogprob(token, float(row[token].item()), top)


def forced_logprob(params: SamplingParams, token: int) -> TokenLogprob | None:
    """A token the grammar forced: the only one allowed, so log-probability 0 (p = 1).

    The model is not consulted for forced tokens (they are fed, never sampled), so there
    are no alternatives to list: ``top`` holds the token alone when alternatives are asked.
    """
    if not params.logprobs:
        return None
    return TokenLogprob(token, 0.0, ((token, 0.0),) if params.top_logprobs else ())
