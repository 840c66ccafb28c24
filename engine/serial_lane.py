"""The serial lane: one request decoded alone, a prefill chunk or one token per step.

For what cannot join the batch: seeded random sampling (its own PRNG key, so the
seed alone decides the output) and models whose caches cannot merge (quantized KV).
Called only by the runner, on the engine thread, between batch steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.grammar import GrammarCompiler, RowGrammar
from engine.request import LogitsProcessor
from engine.sampling import unpack_bitmask

Sampler = Callable[[mx.array], mx.array]


@dataclass
class SerialToken:
    token: int
    logprobs: mx.array


class SerialRow:
    """A single sequence with its own cache; ``step()`` does one bounded unit of work."""

    def __init__(
        self,
        model: Any,
        prompt: list[int],
        cache: list[Any],
        sampler: Sampler,
        processors: list[LogitsProcessor],
        grammar: RowGrammar | None,
        compiler: GrammarCompiler | None,
        prefill_chunk: int,
    ) -> None:
        self._model = model
        self._cache = cache
        self._sampler = sampler
        self._processors = processors
        self.grammar = grammar
        self._compiler = compiler
        self._chunk = prefill_chunk
        self._unprefilled = prompt[:-1]
        self._next_input = prompt[-1]
        self._history = list(prompt)
        self.generated = 0

    def step(self) -> SerialToken | None:
        """Prefill one chunk (returns None) or decode one token."""
        if self._unprefilled:
            chunk, self._unprefilled = (self._unprefilled[: self._chunk],
                                        self._unprefilled[self._chunk :])
            self._model(mx.array(chunk)[None], cache=self._cache)
            mx.eval([c.state for c in self._cache])
            return None
        logits = self._model(mx.array([[self._next_input]]), cache=self._cache)[:, -1, :]
        if self._processors:
            context = mx.array(self._history)
            for processor in self._processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.grammar is not None and self._compiler is not None:
            bitmask = np.full((1, self._compiler.words), -1, dtype=np.int32)
            self.grammar.fill(bitmask, 0)
            allowed = unpack_bitmask(bitmask, logprobs.shape[-1])
            masked = mx.where(allowed, logprobs, -mx.inf)
            masked = masked - mx.logsumexp(masked, axis=-1, keepdims=True)
            token = _as_int(self._sampler(masked))
            self.grammar.consume(token)  # no pipelining here: done-ness is current
        else:
            token = _as_int(self._sampler(logprobs))
        self._next_input = token
        self._history.append(token)
        self.generated += 1
        return SerialToken(token, logprobs[0])


def _as_int(sampled: mx.array) -> int:
    value: int = sampled.reshape(-1)[0].item()  # type: ignore[assignment]
    return value
