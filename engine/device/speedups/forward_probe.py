"""What a forward of ``n`` tokens costs on this device, timed once at a lane's first span.

Fast-forward decides by measured costs, but a user's first agent batch comes before any
span is measured: a fixed threshold decided there and lost (8 forced tool calls from a
fresh process, 0.71x of fast-forward off). A forward is timed at two lengths on a fresh
cache instead, so the first decision already prices a span at what its tokens cost.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.core.step_costs import ForwardCost

# Tokens in the longer probe forward: a forced span's order of size (8 rows x 4 tokens).
PROBE_TOKENS = 32
# Timings a length: the least is kept (the first run of a shape may warm MLX up).
PROBE_RUNS = 2


def forward_cost(model: Any, stream: Any, max_kv_size: int | None = None) -> ForwardCost:
    """``fixed + per_token * n`` fitted to one-token and ``PROBE_TOKENS``-token forwards
    of ``model`` on fresh caches, on the engine thread's ``stream``."""
    one = _timed(model, stream, 1, max_kv_size)
    many = _timed(model, stream, PROBE_TOKENS, max_kv_size)
    per_token = max(0.0, (many - one) / (PROBE_TOKENS - 1))
    return ForwardCost(fixed=max(0.0, one - per_token), per_token=per_token)


def _timed(model: Any, stream: Any, tokens: int, max_kv_size: int | None) -> float:
    best = float("inf")
    ids = mx.array([[i % 7 + 1 for i in range(tokens)]])
    for _ in range(PROBE_RUNS):
        cache = make_prompt_cache(model, max_kv_size)
        started = time.perf_counter()
        with mx.stream(stream):
            mx.eval(model(ids, cache=cache))
        best = min(best, time.perf_counter() - started)
    return best
