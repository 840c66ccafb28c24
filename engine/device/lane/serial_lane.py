"""The serial lane: rows decoded one by one, a prefill chunk or one token per step.

For what cannot join the batch: seeded random sampling (its own PRNG key, so the
seed alone decides the output) and models whose caches cannot merge (quantized KV).
The scheduler admits one row at a time here; it runs between batch steps.

Such rows may carry what batch rows do: a LoRA adapter (its slot runs every forward of the
row) and images (the batch lane's image prefill, a unit a step, into the row's own cache,
before its text is prefilled).

Grammar fast-forward: after a constrained row samples a token, the tokens its grammar
then forces are appended at once and fed with it in the row's next forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.core.lane import LaneCapabilities, LaneRow, LaneStep, RowToken
from engine.device.adapters.row_adapters import RowAdapters, adapters_of, rows_of
from engine.device.rows.batch_row import BatchRow
from engine.device.rows.logprobs import forced_logprob, token_logprob
from engine.device.rows.sampling import (
    GrammarMask,
    Sampler,
    SamplerCache,
    guarded,
    penalty_processors,
    seeded_sampler,
)
from engine.device.vision.prefill import VisionJob, VisionPrefill
from engine.errors import InvalidConstraintError
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.inbound.sampling import LogitsProcessor


@dataclass
class _SerialRow:
    """One sequence with its own cache; ``advance()`` does one bounded unit of work."""

    row: LaneRow
    cache: list[Any]
    sampler: Sampler
    processors: list[LogitsProcessor]
    mask: GrammarMask | None
    unprefilled: list[int]
    pending: list[int]  # decided but not yet fed: the last token, then any forced span
    history: list[int]
    failure: BaseException | None = None
    logprobs: Any = None  # of the last decoded token, (1, vocab)
    generated: int = 0
    adapter: str | None = None  # the LoRA adapter it holds, in ``slot``
    slot: int = 0
    images: VisionJob | None = None  # its image prefill, until its cache holds the images

    def advance(self, model: Any, chunk_size: int, fast_forward: bool,
                vision: VisionPrefill | None) -> list[int] | None:
        """A unit of image work or a prefill chunk (returns None), or decode one token
        (returns it, then the tokens its grammar forces after it when ``fast_forward``)."""
        if self.images is not None:
            assert vision is not None
            if vision.work(self.images):
                self.images = None
            return None
        with rows_of(model, [self.slot]):
            return self._forward(model, chunk_size, fast_forward)

    def _forward(self, model: Any, chunk_size: int, fast_forward: bool) -> list[int] | None:
        if self.unprefilled:
            chunk, self.unprefilled = self.unprefilled[:chunk_size], self.unprefilled[chunk_size:]
            model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            return None
        logits = model(mx.array([self.pending]), cache=self.cache)[:, -1, :]
        if self.processors:
            context = mx.array(self.history)
            for processor in self.processors:
                logits = processor(context, logits)
        if self.mask is not None:
            logits = self.mask.apply(logits)
        self.logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token: int = self.sampler(self.logprobs).reshape(-1)[0].item()  # type: ignore[assignment]
        decided = [token]
        if self.mask is not None:
            grammar = self.mask.grammar
            grammar.consume(token)  # no pipelining here: done-ness is current
            if fast_forward and not grammar.done:
                limit = self.row.params.max_tokens - self.generated - 1
                for forced in grammar.forced(limit):
                    grammar.consume(forced)
                    decided.append(forced)
        self.pending = decided
        self.history.extend(decided)
        self.generated += len(decided)
        return decided


class SerialLane:
    """A lane of rows each decoded alone; implements ``engine.core.lane.Lane``."""

    def __init__(self, model: Any, stream: Any, compiler: GrammarCompiler,
                 samplers: SamplerCache, max_kv_size: int | None, prefill_chunk: int,
                 fast_forward: bool = True, vision: VisionPrefill | None = None) -> None:
        self._model = model
        self.adapters: RowAdapters | None = adapters_of(model)
        self.vision = vision  # the batch lane's image prefill, for rows that run alone
        self._stream = stream
        self._compiler = compiler
        self._samplers = samplers
        self._max_kv_size = max_kv_size
        self._chunk = prefill_chunk
        self.fast_forward = fast_forward
        self._rows: dict[int, _SerialRow] = {}
        self.capabilities = LaneCapabilities(images=vision is not None,
                                             adapters=self.adapters is not None)

    def __len__(self) -> int:
        return len(self._rows)

    def accepts(self, row: LaneRow) -> str | None:
        return self.capabilities.refusal(row)

    def insert(self, rows: Sequence[LaneRow]) -> None:
        for row in rows:
            params = row.params
            sampler = (seeded_sampler(params) if params.needs_serial_lane
                       else self._samplers.for_params(params))
            grammar = (self._compiler.row(params.constraint)
                       if params.constraint is not None else None)
            mask = GrammarMask(grammar, self._compiler.words) if grammar is not None else None
            serial = _SerialRow(row, make_prompt_cache(self._model, self._max_kv_size), sampler,
                                [], mask, row.prompt[:-1], row.prompt[-1:], list(row.prompt))
            serial.processors = [guarded(serial, p) for p in penalty_processors(params)]
            self._rows[row.request_id] = serial
            try:
                self._hold(serial)
            except Exception as exc:  # a bad adapter, a model that reads no images: alone
                serial.failure = exc

    def _hold(self, serial: _SerialRow) -> None:
        """The row's adapter loaded and held, its image prefill set up."""
        row = serial.row
        if row.params.adapter is not None:
            assert self.adapters is not None, "StepCore refuses adapter rows here (accepts)"
            serial.adapter, serial.slot = self.adapters.acquire(row.params.adapter)
        if row.images:
            assert self.vision is not None, "StepCore refuses image rows here (accepts)"
            serial.images = self.vision.job(BatchRow(row, slot=serial.slot),
                                            serial.cache, 0)
            serial.unprefilled = row.prompt[row.vision_end:-1]

    def remove(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            serial = self._rows.pop(request_id, None)
            if serial is None:
                continue
            if serial.mask is not None:
                serial.mask.grammar.close()
            if serial.adapter is not None and self.adapters is not None:
                self.adapters.release(serial.adapter)

    def reset(self) -> list[int]:
        dropped = list(self._rows)
        self.remove(dropped)
        return dropped

    def step(self) -> LaneStep:
        result = LaneStep()
        for request_id, serial in list(self._rows.items()):
            if serial.failure is not None:  # held nothing it needed (``_hold``)
                result.failed[request_id] = serial.failure
                continue
            images = serial.images is not None
            try:
                with mx.stream(self._stream):
                    tokens = serial.advance(self._model, self._chunk, self.fast_forward,
                                            self.vision)
            except InvalidConstraintError as exc:  # the row's own grammar: it fails alone
                result.failed[request_id] = serial.failure or exc
                continue
            except Exception as exc:  # its image or its adapter's work: it fails alone
                if not images:
                    raise  # the model itself failed
                result.failed[request_id] = exc
                continue
            if serial.failure is not None:
                result.failed[request_id] = serial.failure
                continue
            if tokens is None:
                continue  # still prefilling
            result.width += 1
            grammar = serial.mask.grammar if serial.mask is not None else None
            params = serial.row.params
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                result.tokens.append(RowToken(
                    request_id, token,
                    forced_logprob(params, token) if i else
                    token_logprob(params, token, serial.logprobs[0]),
                    grammar_done=last and grammar is not None and grammar.done,
                    forced=i > 0))
        return result
