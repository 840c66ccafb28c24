"""mlx-lm's prefill and decoding batches with the lane's two additions, on its own instances.

A lane's generator keeps one prefill batch and one decoding batch for its life (mlx-lm
extends them in place). ``install`` gives those two instances the lane's subclasses,
never mlx-lm's classes, so another generator in the process (a probe, a user's own) runs
as mlx-lm ships it:

- **row adapters**: each forward runs its rows' adapters (``route``: the model and the
  batch's uids give the context to run it in): prefill, a group's first step (sampled
  while mlx-lm builds the group's decoding batch) and decode;
- **grammar masks**: the decoding step's constrained rows are masked together while the
  forward runs (``BatchMasks``: ``grammar_step.MaskFiller``); a step without such rows is
  mlx-lm's own.

The names these rely on are checked at load (``required``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from engine.device.upstream.required import GENERATOR_FIELDS, require

# The context a batch's forward runs in, given the model and the batch's uids.
RowRoute = Callable[[Any, Sequence[int]], AbstractContextManager[Any]]


class BatchMasks(Protocol):
    """The decoding step's grammar masks, for every constrained row at once."""

    def batched(self, processors: Sequence[Any]) -> list[tuple[int, Any]]:
        """(batch index, grammar processor) of the rows whose mask this fills."""
        ...

    def started(self, rows: Sequence[tuple[int, Any]]) -> bool:
        """Whether any of these rows needs the last step's token (its grammar started)."""
        ...

    def fill(self, rows: Sequence[tuple[int, Any]], tokens: list[int] | None, width: int,
             vocab: int) -> mx.array | None:
        """The batch's allowed-token mask; None when no row is left to mask."""
        ...

    def others(self, processors: Any) -> list[Any]:
        """A row's processors other than its batched grammar (penalties, a caller's own)."""
        ...


def _unrouted(model: Any, uids: Sequence[int]) -> AbstractContextManager[Any]:
    return nullcontext()


class LanePromptBatch(PromptProcessingBatch):  # type: ignore[misc]
    """The prefill batch, whose forwards (and a group's first step) run in ``_route``."""

    _route: RowRoute

    def prompt(self, tokens: list[list[int]]) -> None:
        with self._route(self.model, self.uids):
            super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        with self._route(self.model, self.uids):  # the group's first step is sampled here
            return super().generate(tokens)

    def _copy(self) -> LanePromptBatch:
        copied: LanePromptBatch = super()._copy()  # a split keeps this class and its route
        copied._route = self._route
        return copied


class LaneGenerationBatch(GenerationBatch):  # type: ignore[misc]
    """The decoding batch: its step runs in ``_route``, its constrained rows masked together."""

    _route: RowRoute
    _masks: BatchMasks
    steps_masked: int
    _next_tokens: mx.array
    _next_logprobs: list[mx.array]

    def _step(self) -> tuple[list[int], list[mx.array]]:
        with self._route(self.model, self.uids):
            grammars = self._masks.batched(self.logits_processors)
            if not grammars:
                return super()._step()  # type: ignore[no-any-return]
            return self._masked_step(grammars)

    def _masked_step(self, grammars: list[tuple[int, Any]]) -> tuple[list[int], list[mx.array]]:
        """mlx-lm's step, with one wait on the device before the masks are filled (while
        the forward runs) and one ``where`` over the batch."""
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs: mx.array = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        tokens: list[int] | None = None
        if self._masks.started(grammars):
            mx.eval(inputs, self._current_logprobs)  # the step's one wait on the device
            tokens = inputs.tolist()  # type: ignore[assignment]
        allowed = self._masks.fill(grammars, tokens, len(self.uids), logits.shape[-1])
        if allowed is not None:
            logits = mx.where(allowed, logits, -mx.inf)
        self.steps_masked += 1
        token_context = self._other_processors(logits, inputs)
        if token_context is not None:
            logits, contexts = token_context
        else:
            contexts = []
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._next_tokens = self._sample(logprobs)
        self._next_logprobs = list(logprobs)
        mx.async_eval(self._next_tokens, self._next_logprobs, contexts)  # type: ignore[no-untyped-call]
        if tokens is None:  # no started grammar: the wait is here, as in mlx-lm's step
            mx.eval(inputs, self._current_logprobs)
        read: list[int] = tokens if tokens is not None else inputs.tolist()  # type: ignore[assignment]
        for history, token in zip(self.tokens, read):
            history.append(token)
        return read, self._current_logprobs

    def _other_processors(self, logits: mx.array,
                          inputs: mx.array) -> tuple[mx.array, list[mx.array]] | None:
        """Rows' processors other than the grammar, per row as mlx-lm runs them; None when
        no row has one."""
        others = [self._masks.others(processors) for processors in self.logits_processors]
        if not any(others):
            return None
        rows, contexts = [], []
        for index, processors in enumerate(others):
            row_logits = logits[index:index + 1]
            if processors:
                context = self._token_context[index].update_and_fetch(
                    inputs[index:index + 1])
                contexts.append(context)
                for processor in processors:
                    row_logits = processor(context, row_logits)
            rows.append(row_logits)
        return mx.concatenate(rows, axis=0), contexts

    def _sample(self, logprobs: mx.array) -> mx.array:
        """Each distinct sampler once, on its rows (mlx-lm calls one per row unless the
        whole batch shares one)."""
        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)  # type: ignore[no-any-return]
        groups: dict[int, tuple[Any, list[int]]] = {}
        for index, sampler in enumerate(samplers):
            groups.setdefault(id(sampler), (sampler, []))[1].append(index)
        order: list[int] = []
        parts = []
        for sampler, indices in groups.values():
            order.extend(indices)
            parts.append(sampler(logprobs[mx.array(indices)]).reshape(-1))
        sampled = mx.concatenate(parts)
        return sampled[mx.array(np.argsort(np.array(order)))]


def install(generator: BatchGenerator, masks: BatchMasks,
            route: RowRoute | None = None) -> None:
    """Give ``generator``'s prefill and decoding batches the lane's subclasses; raises
    ``UnsupportedUpstreamError`` where this mlx-lm's generator lacks them."""
    require(generator, "mlx_lm.generate.BatchGenerator", GENERATOR_FIELDS, "the batch lane")
    decoding, prefill = generator._generation_batch, generator._prompt_batch
    route = route or _unrouted
    if type(decoding) is not GenerationBatch or type(prefill) is not PromptProcessingBatch:
        raise TypeError(f"a generator's batches were already replaced: {type(decoding)}, "
                        f"{type(prefill)}")
    decoding.__class__ = LaneGenerationBatch
    decoding._masks = masks
    decoding._route = route
    decoding.steps_masked = 0
    prefill.__class__ = LanePromptBatch
    prefill._route = route
