"""Per-row sampling pieces, all through mlx-lm's public contracts.

- Samplers: rows with the same settings share one sampler object, so mlx-lm makes one
  batched call whenever the whole batch agrees (the common all-greedy case).
- Grammar masks: ``GrammarMask`` fills one row's mask and applies it (the serial lane,
  fast-forward, a group's first step); the decoding batch's rows are masked together
  (``grammar_step``).
- A row's own code (its processors, its grammar) failing fails that row only: the
  failure is recorded on the row and the batch step goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from engine.requests.constraints.grammar import RowGrammar
from engine.requests.inbound.sampling import LogitsProcessor, SamplingParams

Sampler = Callable[[mx.array], mx.array]
SamplerKey = tuple[float, float, float, int]


class FailureSlot(Protocol):
    """Where a row's own failure is recorded (the lane reports it after the step)."""

    failure: BaseException | None


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class SamplerCache:
    """One sampler object per distinct setting, shared by every row that uses it."""

    def __init__(self) -> None:
        self._samplers: dict[SamplerKey, Sampler] = {}

    def for_params(self, params: SamplingParams) -> Sampler:
        if params.greedy:
            return _greedy
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        if key not in self._samplers:
            self._samplers[key] = make_sampler(temp=params.temperature, top_p=params.top_p,
                                               min_p=params.min_p, top_k=params.top_k)
        return self._samplers[key]


def seeded_sampler(params: SamplingParams) -> Sampler:
    """A sampler with its own PRNG key, so a seed reproduces whatever else runs."""
    key = mx.random.key(params.seed or 0)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k:
            logprobs = apply_top_k(logprobs, params.top_k)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=sub)

    return sample


def unpack_bitmask(bitmask: np.ndarray[Any, Any], vocab: int) -> mx.array:
    """(rows, words) int32 llguidance bitmask -> (rows, vocab) bool of allowed tokens."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(mx.bool_)


class GrammarMask:
    """Fills one row's allowed-token mask from its matcher and applies it to logits."""

    def __init__(self, grammar: RowGrammar, words: int) -> None:
        self.grammar = grammar
        self._bitmask = np.empty((1, words), dtype=np.int32)

    def apply(self, logits: mx.array) -> mx.array:
        self.grammar.fill(self._bitmask, 0)
        allowed = unpack_bitmask(self._bitmask, logits.shape[-1])
        return mx.where(allowed, logits, -mx.inf)


def guarded(slot: FailureSlot, processor: LogitsProcessor) -> LogitsProcessor:
    """A row's own processor failing fails that row only, not the whole batch step."""

    def run(tokens: Any, logits: Any) -> Any:
        if slot.failure is not None:
            return logits
        try:
            return processor(tokens, logits)
        except Exception as exc:  # reported to that row's consumer by the lane
            slot.failure = exc
            return logits

    return run


def penalty_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The row's repetition penalty (mlx-lm's) and its own processors."""
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty is not None:
        from mlx_lm.sample_utils import make_logits_processors

        processors.extend(make_logits_processors(
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
        ))
    processors.extend(params.logits_processors)
    return processors
