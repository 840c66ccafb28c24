"""A prefill group's first tokens, read in the step that samples them.

mlx-lm's ``BatchGenerator`` samples a group's first tokens when the group leaves prefill
(``GenerationBatch`` runs the prompt's last token at once) but returns them only from the
next ``next()``, after the whole batch's following forward pass. On Metal that pass is
queued asynchronously and costs little; on the CPU ``async_eval`` computes it in place
(MLX waits once ten tasks are in flight, and a forward is hundreds), so every group's
time to first token carried one extra forward of the whole batch.

The samplers are the public seam: the lane hands mlx-lm wrapped samplers, and the wrapper
logs each call's input (log-probabilities) and output (tokens) during one step. The
group's own calls are the last ones of the step (mlx-lm decodes first, then starts the
group, then prefills others, which samples nothing); they are trusted only if their
sampler objects and row counts are exactly what the group's samplers imply, else nothing
is read and the tokens arrive the usual way one step later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class FirstToken:
    """One row's first token and the log-probabilities it was sampled from."""

    token: int
    logprobs: mx.array


@dataclass(frozen=True)
class _Call:
    sampler: Sampler  # the wrapped sampler (as the lane handed it to mlx-lm)
    logprobs: mx.array
    tokens: mx.array


class SamplerTap:
    """Wraps samplers so one step's sampling calls can be read back afterwards."""

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[Sampler, Sampler]] = {}  # id(inner) -> (inner, wrapper)
        self._calls: list[_Call] = []
        self._armed = False

    def wrap(self, sampler: Sampler) -> Sampler:
        """The same wrapper for the same sampler, so mlx-lm still batches rows sharing it."""
        known = self._wrapped.get(id(sampler))
        if known is not None and known[0] is sampler:
            return known[1]
        tap = self

        def tapped(logprobs: mx.array) -> mx.array:
            tokens = sampler(logprobs)
            if tap._armed:
                tap._calls.append(_Call(tapped, logprobs, tokens))
            return tokens

        self._wrapped[id(sampler)] = (sampler, tapped)
        return tapped

    def arm(self) -> None:
        """Start logging one step's calls (the previous step's log is dropped)."""
        self._calls.clear()
        self._armed = True

    def disarm(self) -> None:
        """Stop logging and drop the log (its arrays would pin device memory)."""
        self._calls.clear()
        self._armed = False

    def group_tokens(self, samplers: Sequence[Sampler],
                     decoded: int) -> list[FirstToken] | None:
        """The first tokens of the group that left prefill this step, in the group's order.

        ``samplers`` are the group's wrapped samplers in that order; ``decoded`` is how many
        rows the step decoded before it. mlx-lm makes one call when every row shares a
        sampler and one call per row otherwise; ``None`` unless the step's calls are the
        decode's ``decoded`` rows followed by exactly the group's.
        """
        if not samplers:
            return None
        shared = all(s is samplers[0] for s in samplers)
        expected = [(samplers[0], len(samplers))] if shared else [(s, 1) for s in samplers]
        if len(self._calls) < len(expected):
            return None
        split = len(self._calls) - len(expected)
        if sum(call.tokens.shape[0] for call in self._calls[:split]) != decoded:
            return None
        calls = self._calls[split:]
        for call, (sampler, rows) in zip(calls, expected):
            if call.sampler is not sampler or call.tokens.shape != (rows,):
                return None
        firsts: list[FirstToken] = []
        for call in calls:
            tokens: Any = call.tokens.tolist()
            firsts.extend(FirstToken(int(token), call.logprobs[i])
                          for i, token in enumerate(tokens))
        return firsts
