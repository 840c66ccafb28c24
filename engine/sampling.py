"""Sampling for the batch lane: one call per step sees every row of the batch.

mlx-lm makes a single sampler call for the whole batch when every row uses the
generator's fallback sampler, so every batch row does and this object applies each
row's settings: grammar masks for constrained rows in one batched ``mx.where``, then
one sampler call per group of rows that share settings (one argmax when all are greedy).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from engine.grammar import GrammarCompiler, RowGrammar
from engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]
SamplerKey = tuple[float, float, float, int]


class BatchRow(Protocol):
    """What the sampler needs to know about a row."""

    grammar: RowGrammar | None
    failure: BaseException | None

    @property
    def params(self) -> SamplingParams: ...


def sampler_key(params: SamplingParams) -> SamplerKey | None:
    """Rows with equal keys are sampled in one call; None means greedy."""
    if params.greedy:
        return None
    return (params.temperature, params.top_p, params.min_p, params.top_k)


def unpack_bitmask(bitmask: np.ndarray[Any, Any], vocab: int) -> mx.array:
    """(rows, words) int32 llguidance bitmask -> (rows, vocab) bool of allowed tokens."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(mx.bool_)


def apply_masks(
    logprobs: mx.array, rows: list[BatchRow | None], tokens: Callable[[], list[int]],
    compiler: GrammarCompiler,
) -> mx.array:
    """Advance each constrained row's matcher by its last token and mask all rows at once."""
    bitmask = np.full((len(rows), compiler.words), -1, dtype=np.int32)
    fed: list[int] | None = None
    for i, row in enumerate(rows):
        grammar = row.grammar if row is not None else None
        if grammar is None or row is None or row.failure is not None:
            continue
        try:
            if grammar.started:
                fed = fed if fed is not None else tokens()
                grammar.consume(fed[i])
            grammar.started = True
            grammar.fill(bitmask, i)
        except Exception as exc:  # this row fails, the batch goes on
            row.failure = exc
            bitmask[i] = -1
    allowed = unpack_bitmask(bitmask, logprobs.shape[-1])
    masked = mx.where(allowed, logprobs, -mx.inf)
    return masked - mx.logsumexp(masked, axis=-1, keepdims=True)


class BatchSampler:
    """The BatchGenerator's fallback sampler, used by every batch row."""

    def __init__(self, rows_for: Callable[[list[int]], list[BatchRow | None]],
                 compiler: Callable[[], GrammarCompiler]) -> None:
        self._rows_for = rows_for
        self._compiler = compiler
        self._samplers: dict[SamplerKey, Sampler] = {}

    def __call__(self, logprobs: mx.array) -> mx.array:
        # mlx-lm calls this from GenerationBatch._step; that batch's uids give the row order.
        batch: Any = sys._getframe(1).f_locals.get("self")
        uids = getattr(batch, "uids", None)
        if uids is None or len(uids) != logprobs.shape[0]:
            raise RuntimeError("BatchSampler must be called by mlx-lm's GenerationBatch._step")
        rows = self._rows_for(list(uids))
        if any(row is not None and row.grammar is not None for row in rows):
            logprobs = apply_masks(
                logprobs, rows, lambda: list(batch._current_tokens.tolist()), self._compiler()
            )
        return self._sample(logprobs, rows)

    def _sample(self, logprobs: mx.array, rows: list[BatchRow | None]) -> mx.array:
        groups: dict[SamplerKey | None, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(sampler_key(row.params) if row is not None else None, []).append(i)
        if len(groups) == 1:
            (key,) = groups
            return self._sampler(key)(logprobs)
        out = mx.zeros((logprobs.shape[0],), dtype=mx.uint32)
        for key, indices in groups.items():
            index = mx.array(indices)
            out[index] = self._sampler(key)(logprobs[index]).astype(mx.uint32)
        return out

    def _sampler(self, key: SamplerKey | None) -> Sampler:
        if key is None:
            return _greedy
        if key not in self._samplers:
            temperature, top_p, min_p, top_k = key
            self._samplers[key] = make_sampler(temp=temperature, top_p=top_p, min_p=min_p,
                                               top_k=top_k)
        return self._samplers[key]


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


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
