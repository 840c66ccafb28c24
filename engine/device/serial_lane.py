"""The serial lane: rows decoded one by one, a prefill chunk or one token per step.

For what cannot join the batch: seeded random sampling (its own PRNG key, so the
seed alone decides the output) and models whose caches cannot merge (quantized KV).
The scheduler admits one row at a time here; it runs between batch steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.device.logprobs import token_logprob
from engine.device.sampling import (
    GrammarMask,
    Sampler,
    SamplerCache,
    guarded,
    penalty_processors,
    seeded_sampler,
)
from engine.errors import InvalidConstraintError
from engine.grammar import GrammarCompiler
from engine.lane import LaneRow, LaneStep, RowToken
from engine.request import LogitsProcessor


@dataclass
class _SerialRow:
    """One sequence with its own cache; ``advance()`` does one bounded unit of work."""

    row: LaneRow
    cache: list[Any]
    sampler: Sampler
    processors: list[LogitsProcessor]
    mask: GrammarMask | None
    unprefilled: list[int]
    next_input: int
    history: list[int]
    failure: BaseException | None = None
    logprobs: Any = None  # of the last decoded token, (1, vocab)

    def advance(self, model: Any, chunk_size: int) -> int | None:
        """Prefill one chunk (returns None) or decode one token (returns it)."""
        if self.unprefilled:
            chunk, self.unprefilled = self.unprefilled[:chunk_size], self.unprefilled[chunk_size:]
            model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            return None
        logits = model(mx.array([[self.next_input]]), cache=self.cache)[:, -1, :]
        if self.processors:
            context = mx.array(self.history)
            for processor in self.processors:
                logits = processor(context, logits)
        if self.mask is not None:
            logits = self.mask.apply(logits)
        self.logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token: int = self.sampler(self.logprobs).reshape(-1)[0].item()  # type: ignore[assignment]
        if self.mask is not None:
            self.mask.grammar.consume(token)  # no pipelining here: done-ness is current
        self.next_input = token
        self.history.append(token)
        return token


class SerialLane:
    """A lane of rows each decoded alone; implements ``engine.lane.Lane``."""

    def __init__(self, model: Any, stream: Any, compiler: GrammarCompiler,
                 samplers: SamplerCache, max_kv_size: int | None, prefill_chunk: int) -> None:
        self._model = model
        self._stream = stream
        self._compiler = compiler
        self._samplers = samplers
        self._max_kv_size = max_kv_size
        self._chunk = prefill_chunk
        self._rows: dict[int, _SerialRow] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def insert(self, rows: Sequence[LaneRow]) -> None:
        for row in rows:
            params = row.params
            sampler = (seeded_sampler(params) if params.needs_serial_lane
                       else self._samplers.for_params(params))
            grammar = (self._compiler.row(params.constraint)
                       if params.constraint is not None else None)
            mask = GrammarMask(grammar, self._compiler.words) if grammar is not None else None
            serial = _SerialRow(row, make_prompt_cache(self._model, self._max_kv_size), sampler,
                                [], mask, row.prompt[:-1], row.prompt[-1], list(row.prompt))
            serial.processors = [guarded(serial, p) for p in penalty_processors(params)]
            self._rows[row.request_id] = serial

    def remove(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            serial = self._rows.pop(request_id, None)
            if serial is not None and serial.mask is not None:
                serial.mask.grammar.close()

    def reset(self) -> list[int]:
        dropped = list(self._rows)
        self.remove(dropped)
        return dropped

    def step(self) -> LaneStep:
        result = LaneStep()
        for request_id, serial in list(self._rows.items()):
            try:
                with mx.stream(self._stream):
                    token = serial.advance(self._model, self._chunk)
            except InvalidConstraintError as exc:  # the row's own grammar: it fails alone
                result.failed[request_id] = serial.failure or exc
                continue
            if serial.failure is not None:
                result.failed[request_id] = serial.failure
                continue
            if token is None:
                continue  # still prefilling
            result.width += 1
            grammar = serial.mask.grammar if serial.mask is not None else None
            result.tokens.append(RowToken(
                request_id, token, token_logprob(serial.row.params, token, serial.logprobs[0]),
                grammar_done=grammar is not None and grammar.done))
        return result
