"""A logits processor that makes a model write given token ids: a test's way to have a
random-weight model produce a family's exact raw output (reasoning markup included),
without a constraint, whose grammar describes only the answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def forcing(ids: Sequence[int]) -> Callable[[Any, Any], Any]:
    """``(tokens, logits) -> logits`` allowing only ``ids[i]`` at the row's i-th step (any
    token after the last: the caller's ``max_tokens`` or a stop ends the row)."""
    import mlx.core as mx

    step = 0

    def process(tokens: Any, logits: Any) -> Any:
        nonlocal step
        if step >= len(ids):
            return logits
        allowed = mx.arange(logits.shape[-1]) == ids[step]
        step += 1
        return mx.where(allowed, logits, -mx.inf)

    return process
