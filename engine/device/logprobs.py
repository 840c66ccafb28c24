"""A sampled token's log-probability and the most likely alternatives, as plain numbers."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.request import SamplingParams, TokenLogprob


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
        top = tuple(zip(top_ids, top_values))
    return TokenLogprob(token, float(row[token].item()), top)
