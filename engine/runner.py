"""The only module that touches the model: loading, the BatchGenerator, the serial lane.

Everything here runs on the engine thread. Rows are keyed by request id; the
mlx-lm BatchGenerator's own uids never leave this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from engine.cache_layout import footprint_of
from engine.channels import TOOL
from engine.config import EngineConfig
from engine.constraints import LarkGrammar
from engine.footprint import ModelFootprint
from engine.grammar import GrammarCompiler, RowGrammar
from engine.models import config_context_limit
from engine.prefix_cache import PrefixStore
from engine.prefix_reuse import PrefixReuse, reuse_policy, sliced
from engine.prompts import PromptRenderer
from engine.request import (
    FinishReason,
    LogitsProcessor,
    SamplingParams,
    TokenLogprob,
)
from engine.sampling import BatchRow, BatchSampler, seeded_sampler
from engine.serial_lane import SerialRow
from engine.tools import (
    ToolSpec,
    forced_call_grammar,
)


@dataclass(frozen=True)
class RowSpec:
    """A request as the runner needs it: token ids and sampling settings."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none


@dataclass(frozen=True)
class TokenOut:
    """One generated token of one row; ``finish`` is set when the row ended with it, and
    then the runner has already let the row go."""

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


@dataclass
class _Row:
    """A row the runner holds: its spec, its grammar, and a failure of its own code."""

    spec: RowSpec
    grammar: RowGrammar | None = None
    failure: BaseException | None = None
    cached_tokens: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.spec.params


class Runner:
    """Owns the model, the tokenizer and the batch; called only from the engine thread."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        self.model_path = model_path
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self.footprint: ModelFootprint | None = None
        self.prompts: PromptRenderer
        self._stream: Any = None
        self._generator: BatchGenerator | None = None
        self._compiler: GrammarCompiler | None = None
        self._rows: dict[int, _Row] = {}  # by request id, batch lane
        self._uid_to_request: dict[int, int] = {}
        self._request_to_uid: dict[int, int] = {}
        self._stop_sequences: dict[tuple[int, ...], StopSequences] = {}
        self._serial: SerialRow | None = None
        self._serial_row: _Row | None = None
        self.reuse: PrefixReuse | None = None
        # A row prefilling a shared head ("leader") makes rows with the same head wait
        # for it, so that parallel branches hit the stored head on their first call.
        self._heads_in_flight: dict[tuple[int, ...], int] = {}
        self._head_of_leader: dict[int, tuple[int, ...]] = {}
        self._deferred: dict[tuple[int, ...], list[_Row]] = {}
        self._cached_report: dict[int, int] = {}

    # ----- loading -----------------------------------------------------------------

    def load(self) -> ModelFootprint:
        """Load weights and tokenizer on this (the engine) thread; probe the cache layout."""
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self.model, self.tokenizer = mlx_load(str(self.model_path))[:2]
        self.prompts = PromptRenderer(self.tokenizer, self.model_path, self.vocab_size)
        self.footprint = self._probe_footprint()
        self._generator = self._new_generator()
        store = PrefixStore(self.config.prefix_cache_bytes, self.config.prefix_cache_ttl,
                            min_tokens=self.config.prefix_min_tokens)
        self.reuse = PrefixReuse(store, reuse_policy(self.footprint))
        return self.footprint

    def _probe_footprint(self) -> ModelFootprint:
        cache = make_prompt_cache(self.model, self.config.max_kv_size)
        with mx.stream(self._stream):
            self.model(mx.array([[0]]), cache=cache)
            mx.eval([c.state for c in cache])
        layers = [fp for layer in cache for fp in footprint_of(layer)]
        return ModelFootprint.of(layers, config_context_limit(self.model_path))

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            sampler=BatchSampler(self._batch_rows_for, self.grammar_compiler),
            completion_batch_size=self.config.max_batch,
            prefill_batch_size=min(self.config.prefill_batch, self.config.max_batch),
            prefill_step_size=self.config.prefill_chunk,
            max_kv_size=self.config.max_kv_size,
            stream=self._stream,
        )

    def grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer._tokenizer, self.vocab_size)
        return self._compiler

    @property
    def live_matchers(self) -> int:
        return self._compiler.live_matchers if self._compiler is not None else 0

    # ----- prompts -------------------------------------------------------------------

    def forced_call_constraint(
        self, tools: Sequence[ToolSpec], choice: str, parallel: bool
    ) -> LarkGrammar:
        """The grammar that forces tool calls, with markers as this tokenizer spells them."""
        start, end = self.prompts.channel_markers()[TOOL]
        compiler = self.grammar_compiler()
        return forced_call_grammar(tools, choice, parallel,
                                   compiler.lark_literal(start), compiler.lark_literal(end))

    @property
    def vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        return int(args.vocab_size) if args is not None else len(self.tokenizer)

    def new_detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    def check_constraint(self, params: SamplingParams) -> None:
        """Compile the row's constraint now so a bad one fails at submit (cached)."""
        if params.constraint is not None:
            self.grammar_compiler().compile(params.constraint)

    # ----- the batch lane --------------------------------------------------------------

    @property
    def generator(self) -> BatchGenerator:
        assert self._generator is not None, "Runner.load() first"
        return self._generator

    def _batch_rows_for(self, uids: list[int]) -> list[BatchRow | None]:
        rows: list[BatchRow | None] = []
        for uid in uids:
            request_id = self._uid_to_request.get(uid)
            rows.append(self._rows.get(request_id) if request_id is not None else None)
        return rows

    def insert(self, specs: Sequence[RowSpec]) -> None:
        """Hand rows to the batch, each starting from the longest reusable KV prefix."""
        rows = [_Row(spec, self._grammar_for(spec.params)) for spec in specs]
        for row in rows:
            self._rows[row.spec.request_id] = row
        self._start(rows)

    def take_cached_tokens(self) -> dict[int, int]:
        """Prompt tokens reused from the prefix cache, per row started since last asked."""
        report, self._cached_report = self._cached_report, {}
        return report

    def _start(self, rows: list[_Row]) -> None:
        ready: list[_Row] = []
        plans = []
        for row in rows:  # in order: the first row with a new head becomes its leader
            head = _head_key(row.spec)
            if head is not None and head in self._heads_in_flight:
                self._deferred.setdefault(head, []).append(row)
            else:
                plans.append(self._prefill_plan(row))
                ready.append(row)
        if not ready:
            return
        uids = self.generator.insert_segments(
            [plan[0] for plan in plans],
            max_tokens=[row.params.max_tokens for row in ready],
            caches=[plan[1] for plan in plans],
            all_tokens=[plan[2] for plan in plans],
            logits_processors=[self._processors(row) for row in ready],
            stop_sequences=[self._stop_sequences_for(row.params) for row in ready],
        )
        for uid, row in zip(uids, ready):
            request_id = row.spec.request_id
            self._uid_to_request[uid] = request_id
            self._request_to_uid[request_id] = uid
            self._cached_report[request_id] = row.cached_tokens

    def _prefill_plan(self, row: _Row) -> tuple[list[list[int]], list[Any] | None, list[int]]:
        """(prompt segments to prefill, starting cache, tokens that cache holds)."""
        prompt, cache, reused = row.spec.prompt, None, 0
        if self.reuse is not None:
            running = {r: self._rows[r].spec.prompt for r in self._request_to_uid}
            found = self.reuse.lookup(prompt, running, self._extract)
            if found is not None:
                cache, reused = found
        row.cached_tokens = reused
        head = row.spec.head_len
        key = _head_key(row.spec)
        if (key is not None and self.reuse is not None and self.reuse.enabled
                and reused < head < len(prompt) - 1):
            # Stop at the head boundary once, store it there, and let its twins wait.
            self._heads_in_flight[key] = row.spec.request_id
            self._head_of_leader[row.spec.request_id] = key
            return [prompt[reused:head], prompt[head:]], cache, prompt[:reused]
        return [prompt[reused:]], cache, prompt[:reused]

    def _extract(self, request_id: int) -> tuple[list[Any], list[int]] | None:
        uid = self._request_to_uid.get(request_id)
        if uid is None:
            return None
        found = self.generator.extract_cache([uid]).get(uid)
        return (list(found[0]), list(found[1])) if found is not None else None

    def _head_stored(self, key: tuple[int, ...]) -> None:
        """The head's prefill ended (stored or abandoned): start the rows waiting on it."""
        leader = self._heads_in_flight.pop(key, None)
        if leader is not None:
            self._head_of_leader.pop(leader, None)
        waiting = self._deferred.pop(key, [])
        if waiting:
            self._start(waiting)

    def remove(self, request_ids: Sequence[int]) -> None:
        """Evict rows at any stage (waiting, queued, prefilling, decoding).

        Their KV memory leaves the batch; what they computed is offered to the prefix
        store (bounded by its byte cap) before it is dropped.
        """
        uids = [self._request_to_uid[r] for r in request_ids if r in self._request_to_uid]
        if uids:
            keep = self.reuse is not None and self.reuse.enabled
            for cache, tokens in self.generator.remove(uids, return_prompt_caches=keep).values():
                assert self.reuse is not None
                self.reuse.keep(tokens, cache)
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        uid = self._request_to_uid.pop(request_id, None)
        if uid is not None:
            self._uid_to_request.pop(uid, None)
        row = self._rows.pop(request_id, None)
        if row is not None and row.grammar is not None:
            row.grammar.close()
        if row is not None:
            key = _head_key(row.spec)
            waiting = self._deferred.get(key) if key is not None else None
            if waiting is not None and row in waiting:
                waiting.remove(row)
        head = self._head_of_leader.get(request_id)
        if head is not None:
            self._head_stored(head)  # abandoned: a waiting twin becomes the leader

    @property
    def batch_rows(self) -> int:
        return len(self._rows)

    def step(self) -> StepResult:
        """One decode step for decoding rows plus one prefill chunk for prefilling rows."""
        progress, responses = self.generator.next()
        result = StepResult(decoding_rows=len(self.generator._generation_batch))
        for prompt_response in progress:
            if prompt_response.end_of_segment and not prompt_response.end_of_prompt:
                self._maybe_store_head(prompt_response.uid)
        for response in responses:
            request_id = self._uid_to_request.get(response.uid)
            row = self._rows.get(request_id) if request_id is not None else None
            if row is None or row.failure is not None:
                continue
            token = int(response.token)
            finish = _finish_reason(response.finish_reason)
            if finish is None and row.grammar is not None and row.grammar.done:
                finish = FinishReason.STOP  # the grammar is complete: nothing may follow
            result.tokens.append(
                TokenOut(row.spec.request_id, token, finish,
                         _logprob(row.params, token, response.logprobs))
            )
            if response.finish_reason is not None:
                if self.reuse is not None and response.prompt_cache is not None:
                    self.reuse.keep(response.all_tokens, response.prompt_cache)
                self._forget(row.spec.request_id)  # mlx-lm already dropped the row
            elif finish is not None:
                self.remove([row.spec.request_id])
        for row in self._rows.values():
            if row.failure is not None:
                result.failed[row.spec.request_id] = row.failure
        return result

    def _maybe_store_head(self, uid: int) -> None:
        request_id = self._uid_to_request.get(uid)
        key = self._head_of_leader.get(request_id) if request_id is not None else None
        if key is None or self.reuse is None:
            return
        found = self._extract(request_id)  # type: ignore[arg-type]
        if found is not None and len(found[1]) >= len(key):
            self.reuse.keep(found[1][: len(key)], [_trimmed(c, len(key)) for c in found[0]])
        self._head_stored(key)

    def reset_batch(self) -> list[int]:
        """Drop every batch row after a model failure; returns their request ids."""
        dropped = list(self._rows)
        self._deferred.clear()
        self._heads_in_flight.clear()
        self._head_of_leader.clear()
        for request_id in dropped:
            self._forget(request_id)
        self._generator = self._new_generator()
        return dropped

    def close(self) -> None:
        """Release every row (and its grammar matcher): the engine is going away."""
        self.reset_batch()
        self.stop_serial()

    # ----- the serial lane -------------------------------------------------------------

    def start_serial(self, spec: RowSpec) -> None:
        row = _Row(spec, self._grammar_for(spec.params))
        params = spec.params
        sampler = (seeded_sampler(params) if params.needs_serial_lane and not params.greedy
                   else _plain_sampler(params))
        self._serial_row = row
        self._serial = SerialRow(
            self.model, spec.prompt, make_prompt_cache(self.model, self.config.max_kv_size),
            sampler, self._processors(row), row.grammar, self._compiler,
            self.config.prefill_chunk,
        )

    def stop_serial(self) -> None:
        if self._serial_row is not None and self._serial_row.grammar is not None:
            self._serial_row.grammar.close()
        self._serial = None
        self._serial_row = None

    @property
    def serial_request(self) -> int | None:
        return self._serial_row.spec.request_id if self._serial_row is not None else None

    def step_serial(self) -> StepResult:
        """One prefill chunk or one token of the serial row."""
        lane, row = self._serial, self._serial_row
        assert lane is not None and row is not None
        result = StepResult(decoding_rows=1)
        try:
            with mx.stream(self._stream):
                out = lane.step()
        except Exception as exc:
            if row.failure is None and not _is_row_error(exc):
                raise  # the model itself failed: the engine's failure path handles it
            result.failed[row.spec.request_id] = row.failure or exc
            self.stop_serial()
            return result
        if row.failure is not None:
            result.failed[row.spec.request_id] = row.failure
            self.stop_serial()
            return result
        if out is None:
            return result  # still prefilling
        finish = None
        if out.token in self._stop_ids(row.params):
            finish = FinishReason.STOP
        elif lane.generated >= row.params.max_tokens:
            finish = FinishReason.LENGTH
        elif row.grammar is not None and row.grammar.done:
            finish = FinishReason.STOP
        result.tokens.append(TokenOut(row.spec.request_id, out.token, finish,
                                      _logprob(row.params, out.token, out.logprobs)))
        if finish is not None:
            self.stop_serial()
        return result

    # ----- per-row pieces ----------------------------------------------------------------

    def _grammar_for(self, params: SamplingParams) -> RowGrammar | None:
        if params.constraint is None:
            return None
        return self.grammar_compiler().row(params.constraint)

    def _processors(self, row: _Row) -> list[LogitsProcessor]:
        params = row.params
        processors: list[LogitsProcessor] = []
        if params.repetition_penalty is not None:
            processors.extend(make_logits_processors(
                repetition_penalty=params.repetition_penalty,
                repetition_context_size=params.repetition_context_size,
            ))
        processors.extend(params.logits_processors)
        return [_guard(row, p) for p in processors]

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


def _head_key(spec: RowSpec) -> tuple[int, ...] | None:
    return tuple(spec.prompt[: spec.head_len]) if spec.head_len else None


def _trimmed(layer: Any, n: int) -> Any:
    """A cache layer cut to its first n tokens (the head), sharing no arrays."""
    return sliced([layer], n)[0]


def _guard(row: _Row, processor: LogitsProcessor) -> LogitsProcessor:
    """A row's own processor failing fails that row only, not the whole batch step."""

    def guarded(tokens: Any, logits: Any) -> Any:
        if row.failure is not None:
            return logits
        try:
            return processor(tokens, logits)
        except Exception as exc:  # reported to that row's consumer
            row.failure = exc
            return logits

    return guarded


def _is_row_error(exc: BaseException) -> bool:
    from engine.grammar import InvalidConstraintError

    return isinstance(exc, InvalidConstraintError)


def _plain_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    sampler: Callable[[mx.array], mx.array] = make_sampler(
        temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
    )
    return sampler


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
