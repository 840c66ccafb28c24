"""The only module that touches the model: loading, the BatchGenerator, the serial lane.

Everything here runs on the engine thread. Rows are keyed by request id; the
mlx-lm BatchGenerator's own uids never leave this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator, StopSequences, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from engine.cache_layout import footprint_of
from engine.config import EngineConfig
from engine.footprint import ModelFootprint
from engine.request import (
    ChatMessage,
    FinishReason,
    LogitsProcessor,
    Prompt,
    SamplingParams,
    TokenLogprob,
)

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class RowSpec:
    """A request as the runner needs it: token ids and sampling settings."""

    request_id: int
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class TokenOut:
    """One generated token of one row; ``finish`` is set when mlx-lm ended the row."""

    request_id: int
    token: int
    finish: FinishReason | None
    logprob: TokenLogprob | None = None


@dataclass
class StepResult:
    """What one step produced: tokens, rows whose own code failed, batch width."""

    tokens: list[TokenOut] = field(default_factory=list)
    failed: dict[int, BaseException] = field(default_factory=dict)
    decoding_rows: int = 0


class Runner:
    """Owns the model, the tokenizer and the batch; called only from the engine thread."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        self.model_path = model_path
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self.footprint: ModelFootprint | None = None
        self._stream: Any = None
        self._generator: BatchGenerator | None = None
        self._uid_to_request: dict[int, int] = {}
        self._request_to_uid: dict[int, int] = {}
        self._specs: dict[int, RowSpec] = {}
        self._row_failures: dict[int, BaseException] = {}
        self._samplers: dict[tuple[float, float, float, int], Sampler] = {}
        self._stop_sequences: dict[tuple[int, ...], StopSequences] = {}
        self._serial: _SerialRow | None = None

    # ----- loading -----------------------------------------------------------------

    def load(self) -> ModelFootprint:
        """Load weights and tokenizer on this (the engine) thread; probe the cache layout."""
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self.model, self.tokenizer = mlx_load(str(self.model_path))[:2]
        self.footprint = self._probe_footprint()
        self._generator = self._new_generator()
        return self.footprint

    def _probe_footprint(self) -> ModelFootprint:
        cache = make_prompt_cache(self.model, self.config.max_kv_size)
        with mx.stream(self._stream):
            self.model(mx.array([[0]]), cache=cache)
            mx.eval([c.state for c in cache])
        layers = [fp for layer in cache for fp in footprint_of(layer)]
        return ModelFootprint.of(layers, _config_context_limit(self.model_path))

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.config.max_batch,
            prefill_batch_size=min(self.config.prefill_batch, self.config.max_batch),
            prefill_step_size=self.config.prefill_chunk,
            max_kv_size=self.config.max_kv_size,
            stream=self._stream,
        )

    # ----- prompts -------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (rendered with the chat template) -> ids."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.render_chat(list(prompt))  # type: ignore[arg-type]
        else:
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"the model at {self.model_path} has no chat template; pass text or token ids"
            )
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size) if hasattr(self.model, "args") else len(
            self.tokenizer
        )

    def new_detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    # ----- the batch lane --------------------------------------------------------------

    @property
    def generator(self) -> BatchGenerator:
        assert self._generator is not None, "Runner.load() first"
        return self._generator

    def insert(self, specs: Sequence[RowSpec]) -> None:
        if not specs:
            return
        uids = self.generator.insert(
            [spec.prompt for spec in specs],
            max_tokens=[spec.params.max_tokens for spec in specs],
            samplers=[self._sampler(spec.params) for spec in specs],  # None = greedy
            logits_processors=[self._processors(spec) for spec in specs],
            stop_sequences=[self._stop_sequences_for(spec.params) for spec in specs],
        )
        for uid, spec in zip(uids, specs):
            self._uid_to_request[uid] = spec.request_id
            self._request_to_uid[spec.request_id] = uid
            self._specs[spec.request_id] = spec

    def remove(self, request_ids: Sequence[int]) -> None:
        """Evict rows at any stage (queued, prefilling, decoding); their caches are freed."""
        uids = [self._request_to_uid[r] for r in request_ids if r in self._request_to_uid]
        if uids:
            self.generator.remove(uids)
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        uid = self._request_to_uid.pop(request_id, None)
        if uid is not None:
            self._uid_to_request.pop(uid, None)
        self._specs.pop(request_id, None)
        self._row_failures.pop(request_id, None)

    @property
    def batch_rows(self) -> int:
        return len(self._request_to_uid)

    def step(self) -> StepResult:
        """One decode step for decoding rows plus one prefill chunk for prefilling rows."""
        _, responses = self.generator.next()
        result = StepResult(decoding_rows=len(self.generator._generation_batch))
        failures = dict(self._row_failures)
        self._row_failures.clear()
        for response in responses:
            request_id = self._uid_to_request.get(response.uid)
            if request_id is None or request_id in failures:
                continue
            spec = self._specs[request_id]
            finish = _finish_reason(response.finish_reason)
            result.tokens.append(
                TokenOut(request_id, int(response.token), finish,
                         _logprob(spec.params, int(response.token), response.logprobs))
            )
            if finish is not None:
                self._forget(request_id)
        for request_id, error in failures.items():
            if request_id in self._request_to_uid:
                result.failed[request_id] = error
        return result

    def reset_batch(self) -> list[int]:
        """Drop every batch row after a model failure; returns their request ids."""
        dropped = list(self._request_to_uid)
        self._uid_to_request.clear()
        self._request_to_uid.clear()
        self._specs.clear()
        self._row_failures.clear()
        self._generator = self._new_generator()
        return dropped

    # ----- the serial lane -------------------------------------------------------------

    def start_serial(self, spec: RowSpec) -> None:
        self._serial = _SerialRow(spec, self._serial_tokens(spec), self._stop_ids(spec.params))

    def stop_serial(self) -> None:
        self._serial = None

    @property
    def serial_request(self) -> int | None:
        return self._serial.spec.request_id if self._serial is not None else None

    def step_serial(self) -> StepResult:
        """Next token of the serial row (its first call prefills the whole prompt)."""
        row = self._serial
        assert row is not None
        result = StepResult(decoding_rows=1)
        try:
            token, logprobs = next(row.tokens)
        except StopIteration:
            token, logprobs = -1, None
        if row.spec.request_id in self._row_failures:
            result.failed[row.spec.request_id] = self._row_failures.pop(row.spec.request_id)
            self._serial = None
            return result
        row.generated += 1
        finish = None
        if token in row.stop_ids:
            finish = FinishReason.STOP
        elif row.generated >= row.spec.params.max_tokens or token < 0:
            finish = FinishReason.LENGTH
        if token >= 0:
            logprob = _logprob(row.spec.params, token, logprobs)
            result.tokens.append(TokenOut(row.spec.request_id, token, finish, logprob))
        if finish is not None:
            self._serial = None
        return result

    def _serial_tokens(self, spec: RowSpec) -> Iterator[tuple[int, Any]]:
        tokens: Iterator[tuple[int, Any]] = generate_step(
            mx.array(spec.prompt),
            self.model,
            self._stream,
            max_tokens=spec.params.max_tokens,
            sampler=self._sampler(spec.params),
            logits_processors=self._processors(spec),
            prompt_cache=make_prompt_cache(self.model, self.config.max_kv_size),
            prefill_step_size=self.config.prefill_chunk,
        )
        return tokens

    # ----- per-row sampling pieces ----------------------------------------------------

    def _sampler(self, params: SamplingParams) -> Sampler | None:
        if params.greedy:
            return None  # the generator's shared greedy sampler: one batched call
        if params.needs_serial_lane:
            return _seeded_sampler(params)
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        # Identical settings share one sampler object so mlx-lm samples them in one call.
        if key not in self._samplers:
            self._samplers[key] = make_sampler(
                temp=params.temperature, top_p=params.top_p, min_p=params.min_p,
                top_k=params.top_k,
            )
        return self._samplers[key]

    def _processors(self, spec: RowSpec) -> list[LogitsProcessor]:
        processors: list[LogitsProcessor] = []
        if spec.params.repetition_penalty is not None:
            processors.extend(make_logits_processors(
                repetition_penalty=spec.params.repetition_penalty,
                repetition_context_size=spec.params.repetition_context_size,
            ))
        processors.extend(spec.params.logits_processors)
        return [self._guard(spec.request_id, p) for p in processors]

    def _guard(self, request_id: int, processor: LogitsProcessor) -> LogitsProcessor:
        # A row's own processor failing must fail that row only, not the batch step.
        def guarded(tokens: Any, logits: Any) -> Any:
            if request_id in self._row_failures:
                return logits
            try:
                return processor(tokens, logits)
            except Exception as exc:
                self._row_failures[request_id] = exc
                return logits

        return guarded

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        return eos | frozenset(params.stop_token_ids)

    def _stop_sequences_for(self, params: SamplingParams) -> StopSequences:
        key = tuple(sorted(self._stop_ids(params)))
        if key not in self._stop_sequences:
            self._stop_sequences[key] = StopSequences([(t,) for t in key] or None)
        return self._stop_sequences[key]

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        return self._stop_ids(params)


@dataclass
class _SerialRow:
    spec: RowSpec
    tokens: Iterator[tuple[int, Any]]
    stop_ids: frozenset[int]
    generated: int = 0


def _finish_reason(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    return FinishReason.LENGTH if reason == "length" else FinishReason.STOP


def _logprob(params: SamplingParams, token: int, logprobs: Any) -> TokenLogprob | None:
    if not params.logprobs or logprobs is None:
        return None
    row = logprobs.reshape(-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = params.top_logprobs
        ids = mx.argpartition(-row, k - 1)[:k]
        values = row[ids]
        order = mx.argsort(-values)
        top_ids: list[int] = ids[order].tolist()  # type: ignore[assignment]
        top_values: list[float] = values[order].tolist()
        top = tuple(zip(top_ids, top_values))
    return TokenLogprob(token, float(row[token].item()), top)


def _seeded_sampler(params: SamplingParams) -> Sampler:
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


def _config_context_limit(model_path: Path) -> int | None:
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = config.get(name) or (config.get("text_config") or {}).get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None
