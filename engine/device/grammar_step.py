"""The decoding batch's grammar masks, filled while its forward runs, applied in one op.

mlx-lm applies logits processors row by row: each constrained row read its last token
(a device sync), filled its own mask and masked its own slice of the logits, in series
with the forward, and any processor in the batch made every row a slice and a concat.
Here the decoding batch's constrained rows are masked together:

- the step's forward is built and queued, then the host waits once for the tokens the
  last step sampled; the matchers consume them and llguidance fills every constrained
  row's bitmask on its own threads (the GIL released) while the device runs the forward;
- the bitmask is unpacked on the device and one ``where`` masks every row; rows without a
  grammar are all-allowed.

No Python worker thread: it would hold the GIL the engine thread needs back after each
MLX call (measured: 0.79-0.83 of plain rows' tok/s with one, 0.90-0.95 without, 16 rows
all constrained in the host regime).

The rest of a step (other processors, sampling, the lookahead) is mlx-lm's. A group's
first step runs in mlx-lm's own batch before it joins: its rows use the per-row path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch

from engine.device.sampling import FailureSlot, GrammarMask
from engine.requests.constraints.grammar import RowGrammar, fill_rows


class GrammarProcessor:
    """A constrained row's logits processor (mlx-lm's ``(tokens, logits) -> logits``).

    Run by mlx-lm (a group's first step) it advances the row's matcher by the last token
    and masks the row alone; in the lane's decoding batch it is a marker, and
    ``MaskFiller`` does the same work for every such row at once. A failure fails the
    row only (recorded on ``slot``; its logits pass unmasked, and the lane ends it).
    """

    def __init__(self, slot: FailureSlot, mask: GrammarMask) -> None:
        self.slot = slot
        self.mask = mask

    @property
    def grammar(self) -> RowGrammar:
        return self.mask.grammar

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.slot.failure is not None:
            return logits
        try:
            grammar = self.grammar
            if grammar.started:
                last: int = tokens[-1].item()  # type: ignore[assignment]
                grammar.consume(last)
            grammar.started = True
            return self.mask.apply(logits)
        except Exception as exc:  # reported to that row's consumer by the lane
            self.slot.failure = exc
            return logits


class MaskFiller:
    """Advances a batch's matchers and fills their masks in one parallel call.

    Runs on the engine thread: the matchers consume the last step's tokens (a few
    microseconds a row), then llguidance fills every row's bitmask on its own threads with
    the GIL released, while the device runs the step's forward. No Python worker: one
    would hold the GIL the engine thread needs back after each MLX call (a 5 ms switch
    interval at worst, measured as 2 ms a step at 16 rows).
    """

    def __init__(self, words: int, threads: int | None = None) -> None:
        self._words = words
        self._threads = threads
        self._executor: Any = None  # made at the first constrained step: text rows start none
        self._shifts = mx.arange(32, dtype=mx.uint32)

    def fill(self, rows: Sequence[tuple[int, GrammarProcessor]], tokens: list[int] | None,
             width: int, vocab: int) -> mx.array | None:
        """The batch's (``width``, ``vocab``) allowed-token mask; ``tokens`` by batch row.

        None when every constrained row failed (their failures are on their slots).
        """
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._threads)
        bitmask = np.full((width, self._words), -1, dtype=np.int32)
        live: list[tuple[RowGrammar, int]] = []
        slots: dict[int, FailureSlot] = {}
        for index, processor in rows:
            slot, grammar = processor.slot, processor.grammar
            if slot.failure is not None:
                continue
            try:
                if grammar.started:
                    assert tokens is not None, "a started grammar's token was not read"
                    grammar.consume(tokens[index])
                grammar.started = True
            except Exception as exc:
                slot.failure = exc
                continue
            live.append((grammar, index))
            slots[index] = slot
        if not live:
            return None
        for index, failure in fill_rows(self._executor, live, bitmask).items():
            slots[index].failure = failure
            bitmask[index] = -1
        # Unpacked on the device: 4 bytes a 32 tokens cross, not one byte a token.
        words = mx.array(bitmask.view(np.uint32))
        bits = (words[:, :, None] >> self._shifts) & 1
        return bits.reshape(width, -1)[:, :vocab].astype(mx.bool_)


class LaneGenerationBatch(GenerationBatch):  # type: ignore[misc]
    """mlx-lm's decoding batch, with its constrained rows masked together (``MaskFiller``).

    Installed on a generator's decoding batch by ``install``; a step without constrained
    rows is mlx-lm's own.
    """

    _masks: MaskFiller
    steps_masked: int
    _next_tokens: mx.array
    _next_logprobs: list[mx.array]

    def _step(self) -> tuple[list[int], list[mx.array]]:
        grammars = [(index, processor) for index, processors in enumerate(self.logits_processors)
                    for processor in (processors or ()) if isinstance(processor, GrammarProcessor)]
        if not grammars:
            return super()._step()  # type: ignore[no-any-return]
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs: mx.array = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        tokens: list[int] | None = None
        if any(processor.grammar.started for _, processor in grammars):
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
        """Rows' processors other than the grammar (penalties, a caller's own), per row
        as mlx-lm runs them; None when no row has one."""
        others = [[p for p in (processors or ()) if not isinstance(p, GrammarProcessor)]
                  for processors in self.logits_processors]
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


def install(generator: BatchGenerator, masks: MaskFiller) -> bool:
    """Make the generator's decoding batch a ``LaneGenerationBatch``; False where this
    mlx-lm's batch lacks what it overrides (the lane then keeps per-row processors)."""
    batch: Any = getattr(generator, "_generation_batch", None)
    if type(batch) is not GenerationBatch or not all(
            hasattr(batch, name) for name in _FIELDS):
        return False
    batch.__class__ = LaneGenerationBatch
    batch._masks = masks
    batch.steps_masked = 0
    return True


_FIELDS = ("_next_tokens", "_next_logprobs", "_current_tokens", "_current_logprobs",
           "_token_context", "logits_processors", "samplers", "fallback_sampler", "tokens",
           "prompt_cache", "model", "uids")
