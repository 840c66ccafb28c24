"""The batch lane: every batchable row in one mlx-lm ``BatchGenerator``.

Rows are keyed by request id; the generator's own uids never leave this module. The
generator is given no stop sequences and no length limit of its own, so it never ends
a row: ``engine.core.update`` decides, and the loop calls ``remove``. Which admitted rows
prefill now, in which groups and segments, sharing which heads, is the pure
``PrefillPlanner``'s decision (``engine.core``), handed to the lane when it is built; the
lane carries it out. Before a row is prefilled its prompt is looked up in the prefix
cache (stored entries and running rows); the first row with a new shared head prefills
it as its own segment, stores it, and the rows with the same head wait for it.

Rows reach the generator in prefill groups of at most ``prefill_batch``. mlx-lm returns a
step's decoded tokens only after that step's prefill, so rows fed while a group is on its
last prompt chunk would hold back that group's first tokens for their whole prefill. New
rows therefore wait until every row in the group ahead is either still more than a chunk
from the end of its prompt or has produced its first token; the wait is at most two steps.

A group's first tokens are read from its samplers in the step that samples them (see
``first_tokens``), one step before mlx-lm returns them, except for constrained rows,
whose grammar learns of the token only in that next step.

Grammar fast-forward: when a constrained row's grammar forces two or more tokens after the
token just returned, the row leaves the generator with its cache, is fed the forced span
in one forward (``forced_spans``), samples its next free token there, and rejoins the
generator with that token as a one-token segment. A chain of choice, span, choice, span
runs as several such forwards in the same step, up to ``_SPAN_ROUNDS``.

Speculation: while the lane holds at most ``speculation`` rows, greedy rows leave the
generator and are decoded by ``speculation`` on their own caches, several tokens a step
where prompt-lookup drafts are accepted; they rejoin when load rises or drafts miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine.core.drafts import ShadowDraft
from engine.core.lane import LaneRow, LaneStep, RowToken
from engine.core.prefill_planner import HeadKey, PrefillPlanner
from engine.device.first_tokens import FirstToken, Sampler, SamplerTap
from engine.device.forced_spans import forward_spans, spans_supported
from engine.device.logprobs import forced_logprob, token_logprob
from engine.device.prefix_reuse import PrefixReuse
from engine.device.rejoin import decoding, direct_join_supported, join_decoding, next_inputs
from engine.device.row_cache import copied, trims_exactly
from engine.device.sampling import (
    GrammarMask,
    SamplerCache,
    grammar_processor,
    guarded,
    penalty_processors,
)
from engine.device.speculation import (
    ACCEPTANCE_FLOOR,
    DRAFT_TOKENS,
    IDLE_CHECKS,
    SpeculatingRow,
    eligible,
    speculate,
)
from engine.device.speedups import cache_kinds
from engine.requests.constraints.grammar import GrammarCompiler, RowGrammar
from engine.requests.inbound.sampling import LogitsProcessor

# The generator must never end a row by length itself (engine.core.update decides).
_NO_LIMIT = 1 << 62
# Rounds bound how long one step may be held by span forwards.
_SPAN_ROUNDS = 4


def min_span(rows: int) -> int:
    """The shortest forced span worth a forward of its own with ``rows`` in the lane.

    A span costs its rows a forward of their own and, to rejoin mlx-lm's generator, a
    second one, and only the rows with the span advance. Measured here (SmolLM2-135M
    f32, 2 cores): a lone row's 5-token span forward ~120 ms and its rejoin ~75 ms against
    ~70 ms a step, so alone three forced tokens repay them. Beside a batch the rows reach
    their spans at different steps, the batch keeps stepping for the others, and the two
    forwards are added to its steps: with spans of four or more taken, schema answers
    (4-5 token spans) lost 13-14% at 4-8 rows (bench/agent_decoding.py), while the
    envelope of a tool call (8-15 tokens) still won.
    """
    return 3 if rows <= 1 else 8


@dataclass(eq=False)  # rows are compared by identity: two requests may look alike
class _BatchRow:
    """A row the lane holds: its request, its grammar, a failure of its own code."""

    row: LaneRow
    grammar: RowGrammar | None = None
    failure: BaseException | None = None
    cached_tokens: int = 0
    head_len: int = 0  # the row's shared head: its chat head, or a prefix it shares
    sampler: Sampler | None = None  # as handed to the generator (wrapped by the tap)
    output: list[int] = field(default_factory=list)  # tokens reported, forced ones included
    shadow: ShadowDraft | None = None  # its drafts, compared with what it decodes


    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def request_id(self) -> int:
        return self.row.request_id

    @property
    def prompt(self) -> list[int]:
        return self.row.prompt


@dataclass(eq=False)
class _SpanRow:
    """A row fast-forwarding: out of the generator, its cache and the tokens not yet in it."""

    held: _BatchRow
    cache: list[Any]
    history: list[int]  # the tokens its cache holds
    pending: list[int]  # decided (forced or sampled) but not yet fed


class BatchLane:
    """Continuous batching on mlx-lm's BatchGenerator; implements ``Lane``."""

    def __init__(self, model: Any, stream: Any, compiler: GrammarCompiler,
                 samplers: SamplerCache, reuse: PrefixReuse,
                 planner: PrefillPlanner[_BatchRow], *, max_batch: int,
                 max_kv_size: int | None, fast_forward: bool = True,
                 speculation: int = 0) -> None:
        self._model = model
        self._stream = stream
        self._compiler = compiler
        self._samplers = samplers
        self.reuse = reuse
        # When admitted rows prefill, and how (shared heads, one group at a time): the pure
        # policy's decision; its group and chunk sizes are the generator's too.
        self._planner = planner
        self._options = dict(completion_batch_size=max_batch,
                             prefill_batch_size=planner.group_size,
                             prefill_step_size=planner.chunk, max_kv_size=max_kv_size)
        self._generator = self._new_generator()
        self._no_stops = StopSequences(None)
        self._rows: dict[int, _BatchRow] = {}
        self._uid_to_request: dict[int, int] = {}
        self._request_to_uid: dict[int, int] = {}
        self._cached_report: dict[int, int] = {}
        # First tokens reported before the generator returns them: request id -> token.
        self._tap = SamplerTap()
        self._early: dict[int, int] = {}
        # Rows rejoined with their next input: the generator echoes that token back.
        self._echo: dict[int, int] = {}
        # Both feed several tokens at once: every cache kind but quantized KV takes them.
        supported = spans_supported(model, max_kv_size)
        self.fast_forward = fast_forward and supported
        self.speculation = speculation if supported else 0
        self.asked = (fast_forward, speculation)  # the settings, for stats().speedups
        layers = make_prompt_cache(model, max_kv_size)
        self.cache_kinds = cache_kinds(layers)
        self.trims = self._trims = trims_exactly(layers)
        self._speculating: dict[int, SpeculatingRow] = {}

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(self._model, stream=self._stream, **self._options)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def generator(self) -> BatchGenerator:
        """The mlx-lm generator (for inspection: the lane alone drives it)."""
        return self._generator

    # ----- insert ------------------------------------------------------------------------

    def insert(self, rows: Sequence[LaneRow]) -> None:
        held = [_BatchRow(row, head_len=row.head_len) for row in rows]
        for held_row in held:
            params = held_row.row.params
            if params.constraint is not None:
                held_row.grammar = self._compiler.row(params.constraint)
            self._rows[held_row.row.request_id] = held_row
        self._start(held)

    def _start(self, rows: list[_BatchRow], *, joining: bool = False) -> None:
        """Queue rows for the generator; ``joining`` rows may join the group in flight."""
        self._planner.queue(rows, joining=joining)
        self._feed(joining)

    def _feed(self, joining: bool = False) -> None:
        """Give the generator the rows the planner says may prefill now.

        Twins released by a stored head (``joining``) join the leader's group while it
        has room: they were admitted with it, and waiting for the leader's first token
        would cost them two steps.
        """
        taken = self._planner.take_ready(self._prefill_plan, joining)
        if not taken:
            return
        ready = [row for row, _ in taken]
        plans = [plan for _, plan in taken]
        for row in ready:
            row.sampler = self._tap.wrap(self._samplers.for_params(row.row.params))
        uids = self._generator.insert_segments(
            [plan[0] for plan in plans],
            max_tokens=[_NO_LIMIT] * len(ready),
            caches=[plan[1] for plan in plans],
            all_tokens=[plan[2] for plan in plans],
            samplers=[row.sampler for row in ready],
            logits_processors=[self._processors(row) for row in ready],
            stop_sequences=[self._no_stops] * len(ready),
        )
        for uid, row, (segments, *_) in zip(uids, ready, plans):
            request_id = row.row.request_id
            self._uid_to_request[uid] = request_id
            self._request_to_uid[request_id] = uid
            self._cached_report[request_id] = row.cached_tokens
            self._planner.started(request_id, sum(len(part) for part in segments))

    def _processors(self, row: _BatchRow) -> list[LogitsProcessor]:
        processors = [guarded(row, p) for p in penalty_processors(row.row.params)]
        if row.grammar is not None:  # last: the mask applies to the final logits
            mask = GrammarMask(row.grammar, self._compiler.words)
            processors.append(guarded(row, grammar_processor(mask)))
        return processors

    def _prefill_plan(self, row: _BatchRow) -> tuple[list[list[int]], list[Any] | None,
                                                     list[int]]:
        """(prompt segments to prefill, starting cache, tokens that cache holds)."""
        prompt, cache, reused = row.row.prompt, None, 0
        running = {r: self._rows[r].row.prompt for r in self._request_to_uid}
        found = self.reuse.lookup(prompt, running, self._extract)
        if found is not None:
            cache, reused = found
        row.cached_tokens = reused
        segments = self._planner.segments(row, reused)
        return segments, cache, prompt[:reused]

    def _extract(self, request_id: int) -> tuple[list[Any], list[int]] | None:
        uid = self._request_to_uid.get(request_id)
        if uid is None:
            return None
        found = self._generator.extract_cache([uid]).get(uid)
        if found is None:
            return None
        # Copied now, so the running batch's buffers are not pinned by a lazy slice.
        return copied(list(found[0])), list(found[1])

    def _head_stored(self, key: HeadKey) -> None:
        """The head's prefill ended (stored or abandoned): start the rows waiting on it."""
        waiting = self._planner.head_done(key)
        if waiting:
            self._start(waiting, joining=True)

    def take_cached_tokens(self) -> dict[int, int]:
        report, self._cached_report = self._cached_report, {}
        return report

    # ----- remove ------------------------------------------------------------------------

    def remove(self, request_ids: Sequence[int]) -> None:
        uids = [self._request_to_uid[r] for r in request_ids if r in self._request_to_uid]
        if uids:
            keep = self.reuse.enabled
            for cache, tokens in self._generator.remove(uids, return_prompt_caches=keep).values():
                self.reuse.keep(tokens, cache)
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        spec = self._speculating.pop(request_id, None)
        if spec is not None and self.reuse.enabled:
            self.reuse.keep(spec.history, spec.cache)
        uid = self._request_to_uid.pop(request_id, None)
        if uid is not None:
            self._uid_to_request.pop(uid, None)
        self._early.pop(request_id, None)
        self._echo.pop(request_id, None)
        row = self._rows.pop(request_id, None)
        self._cached_report.pop(request_id, None)
        if row is None:
            return
        if row.grammar is not None:
            row.grammar.close()
        released = self._planner.forget(row)  # a leader abandoned: a twin leads now
        if released:
            self._start(released, joining=True)

    def reset(self) -> list[int]:
        dropped = list(self._rows)
        self._planner.reset()
        self._early.clear()
        self._echo.clear()
        self._speculating.clear()
        for request_id in dropped:
            self._forget(request_id)
        self._generator = self._new_generator()
        return dropped

    # ----- step --------------------------------------------------------------------------

    def step(self) -> LaneStep:
        """One decode step for decoding rows plus one prefill chunk for prefilling rows."""
        self._tap.arm()
        try:
            progress, responses = self._generator.next()
            firsts = self._first_tokens(progress, decoded=len(responses))
        finally:
            self._tap.disarm()
        result = LaneStep(width=len(responses))
        for prompt_response in progress:
            request_id = self._uid_to_request.get(prompt_response.uid)
            if request_id is not None:
                done, total = prompt_response.progress
                self._planner.progressed(request_id, total - done)
            if prompt_response.end_of_segment and not prompt_response.end_of_prompt:
                self._maybe_store_head(prompt_response.uid)
            elif prompt_response.end_of_prompt and self.reuse.snapshots:
                self._snapshot_prompt(prompt_response.uid)
        decoded: list[int] = []  # rows whose token came from the generator's decode
        for response in responses:
            request_id = self._uid_to_request.get(response.uid)
            row = None
            if request_id is not None:
                self._planner.first_token(request_id)
                row = self._rows.get(request_id)
            if row is None or row.failure is not None:
                continue
            token = int(response.token)
            echoed = self._echo.pop(row.row.request_id, None)
            if echoed is not None:
                if echoed != token:  # the joined row was fed something else: end it
                    row.failure = RuntimeError(f"rejoined with {echoed}, fed {token}")
                continue
            reported = self._early.pop(row.row.request_id, None)
            if reported is not None:
                if reported != token:  # the tap's reading was wrong: say so, end the row
                    row.failure = RuntimeError(
                        f"first token read early as {reported}, generated as {token}")
                continue
            decoded.append(row.row.request_id)
            result.tokens.append(RowToken(
                row.row.request_id, token,
                token_logprob(row.row.params, token, response.logprobs),
                grammar_done=row.grammar is not None and row.grammar.done))
        for row, first in firsts:
            request_id = row.row.request_id
            self._planner.first_token(request_id)
            self._early[request_id] = first.token
            result.tokens.append(RowToken(
                request_id, first.token,
                token_logprob(row.row.params, first.token, first.logprobs)))
        for produced in result.tokens:
            self._rows[produced.request_id].output.append(produced.token)
        if self.fast_forward:
            self._fast_forward(result)
        if self.speculation:
            self._speculate(decoded, result)
        for request_id, row in self._rows.items():
            if row.failure is not None:
                result.failed[request_id] = row.failure
        self._feed()  # the group ahead has its first tokens: the next one prefills now
        result.cached_tokens = self.take_cached_tokens()
        self.reuse.tick()
        return result

    def _first_tokens(self, progress: Sequence[Any],
                      decoded: int) -> list[tuple[_BatchRow, FirstToken]]:
        """First tokens of the rows that left prefill in this step, where they can be read."""
        rows = [self._rows.get(self._uid_to_request.get(p.uid, -1))
                for p in progress if p.end_of_prompt]
        group = [row for row in rows if row is not None and row.sampler is not None]
        if not group or len(group) != len(rows):
            return []
        firsts = self._tap.group_tokens([row.sampler for row in group if row.sampler],
                                        decoded)
        if firsts is None:
            return []
        return [(row, first) for row, first in zip(group, firsts)
                if row.grammar is None and row.failure is None]

    # ----- fast-forward -----------------------------------------------------------------

    def _fast_forward(self, result: LaneStep) -> None:
        """Rows whose grammar now forces a span: feed it at once, sample, rejoin."""
        last: dict[int, RowToken] = {token.request_id: token for token in result.tokens}
        starting: list[tuple[_BatchRow, list[int]]] = []
        shortest = min_span(len(self._rows))
        for request_id, token in last.items():
            row = self._rows[request_id]
            if (row.grammar is None or row.failure is not None or token.grammar_done
                    or request_id not in self._request_to_uid):
                continue
            span = row.grammar.forced(self._budget(row))
            if len(span) >= shortest:
                starting.append((row, span))
        if not starting:
            return
        taken = self._take_out([row for row, _ in starting])
        spanning = []
        for (row, span), (cache, history) in zip(starting, taken):
            spanning.append(_SpanRow(row, cache, history, []))
            self._take_forced(row, span, spanning[-1], result)
        active = [s for s in spanning if self._goes_on(s.held)]
        for round_ in range(_SPAN_ROUNDS):
            if not active:
                break
            with mx.stream(self._stream):
                out = forward_spans(self._model, [s.cache for s in active],
                                    [s.pending for s in active])
            chained = []
            for i, span_row in enumerate(active):
                span_row.cache = out.caches[i]
                span_row.history += span_row.pending
                span_row.pending = []
                if self._sample_after_span(span_row, out.logits[i:i + 1], result):
                    row = span_row.held
                    assert row.grammar is not None
                    more = row.grammar.forced(self._budget(row))
                    if len(more) >= shortest and round_ + 1 < _SPAN_ROUNDS:
                        self._take_forced(row, more, span_row, result)
                        chained.append(span_row)
            active = [s for s in chained if self._goes_on(s.held)]
        self._rejoin(spanning)

    @staticmethod
    def _goes_on(row: _BatchRow) -> bool:
        """A row still decoding after its span: not failed, its grammar not complete."""
        return row.failure is None and row.grammar is not None and not row.grammar.done

    def _budget(self, row: _BatchRow) -> int:
        """Forced tokens the row may still take, leaving room for the token sampled after."""
        return row.row.params.max_tokens - row.generated - 1

    def _take_forced(self, row: _BatchRow, span: list[int], span_row: _SpanRow,
                     result: LaneStep) -> None:
        assert row.grammar is not None
        params = row.row.params
        for token in span:
            try:
                row.grammar.consume(token)
            except Exception as exc:  # the row's own grammar: it fails alone
                row.failure = exc
                return
            span_row.pending.append(token)
            row.output.append(token)
            result.tokens.append(RowToken(row.row.request_id, token,
                                          forced_logprob(params, token),
                                          grammar_done=row.grammar.done, forced=True))

    def _sample_after_span(self, span_row: _SpanRow, logits: mx.array,
                           result: LaneStep) -> bool:
        """Sample the token after a span as mlx-lm would (penalties, mask, sampler)."""
        row = span_row.held
        grammar = row.grammar
        assert grammar is not None and row.sampler is not None
        params = row.row.params
        try:
            with mx.stream(self._stream):
                processors = penalty_processors(params)
                if processors:
                    context = mx.array(span_row.history)
                    for processor in processors:
                        logits = processor(context, logits)
                logits = GrammarMask(grammar, self._compiler.words).apply(logits)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                token: int = row.sampler(logprobs).reshape(-1)[0].item()  # type: ignore[assignment]
                logprob = token_logprob(params, token, logprobs)
            grammar.consume(token)
        except Exception as exc:  # the row's own code: it fails alone
            row.failure = exc
            return False
        span_row.pending = [token]
        row.output.append(token)
        result.tokens.append(RowToken(row.row.request_id, token, logprob,
                                      grammar_done=grammar.done))
        return not grammar.done

    def _rejoin(self, spanning: list[_SpanRow]) -> None:
        """Hand fast-forwarded rows back to the generator with their undecoded tokens; a
        row that failed before anything was decided is not handed back (it ends now)."""
        rows = [s for s in spanning if s.pending]
        for span_row in rows:
            assert span_row.held.grammar is not None
            span_row.held.grammar.started = False  # its pending tokens are consumed already
        self._put_back([s.held for s in rows], [s.cache for s in rows],
                       [s.history for s in rows], [s.pending for s in rows])

    # ----- rows leaving and rejoining the generator ---------------------------------------

    def _take_out(self, rows: list[_BatchRow]) -> list[tuple[list[Any], list[int]]]:
        """Remove decoding rows from the generator: each one's cache and the tokens it holds."""
        uids = [self._request_to_uid.pop(row.row.request_id) for row in rows]
        taken = self._generator.remove(uids, return_prompt_caches=True)
        for uid in uids:
            self._uid_to_request.pop(uid, None)
        return [(list(taken[uid][0]), list(taken[uid][1])) for uid in uids]

    def _put_back(self, rows: list[_BatchRow], caches: list[list[Any]],
                  histories: list[list[int]], pending: list[list[int]]) -> None:
        """Rows rejoin the generator from their caches; ``pending`` is fed first.

        A row with one token to feed joins the decoding batch directly (its token is fed
        by the batch's next forward); one with more goes through a prompt segment.
        """
        if not rows:
            return
        direct = [i for i, tokens in enumerate(pending) if len(tokens) == 1]
        if direct and direct_join_supported(self._generator):
            with mx.stream(self._stream):
                uids = join_decoding(
                    self._generator, [caches[i] for i in direct],
                    [histories[i] for i in direct], [pending[i][0] for i in direct],
                    [rows[i].sampler for i in direct],
                    [self._processors(rows[i]) for i in direct], self._no_stops, _NO_LIMIT)
            for uid, i in zip(uids, direct):
                self._register(uid, rows[i])
                self._echo[rows[i].row.request_id] = pending[i][0]
            chosen = set(direct)
            keep = [i for i in range(len(rows)) if i not in chosen]
            rows, caches = [rows[i] for i in keep], [caches[i] for i in keep]
            histories, pending = [histories[i] for i in keep], [pending[i] for i in keep]
            if not rows:
                return
        uids = self._generator.insert_segments(
            [[tokens] for tokens in pending],
            max_tokens=[_NO_LIMIT] * len(rows),
            caches=caches,
            all_tokens=histories,
            samplers=[row.sampler for row in rows],
            logits_processors=[self._processors(row) for row in rows],
            stop_sequences=[self._no_stops] * len(rows),
        )
        for uid, row in zip(uids, rows):
            self._register(uid, row)

    def _register(self, uid: int, row: _BatchRow) -> None:
        self._uid_to_request[uid] = row.row.request_id
        self._request_to_uid[row.row.request_id] = uid

    # ----- speculation ------------------------------------------------------------------

    def _speculate(self, decoded: list[int], result: LaneStep) -> None:
        """At low load, greedy rows check prompt-lookup drafts outside the generator."""
        if len(self._rows) > self.speculation:
            self._leave(list(self._speculating.values()))
            return
        floor = ACCEPTANCE_FLOOR * len(self._rows)  # a bigger batch makes a row's step cheaper
        entering = []
        for request_id in decoded:
            row = self._rows[request_id]
            if self._shadow(row) and row.shadow is not None and row.shadow.acceptance.mean >= floor:
                entering.append(row)
        if entering:
            self._enter(entering, result)
        leaving = []
        for request_id, spec in self._speculating.items():
            row = self._rows[request_id]
            budget = row.row.params.max_tokens - row.generated
            if budget <= 0 or row.failure is not None:
                continue  # it ends at this step's tokens
            try:
                with mx.stream(self._stream):
                    tokens = speculate(self._model, spec, budget)
            except Exception as exc:  # the row's own grammar: it fails alone
                row.failure = exc
                continue
            result.tokens.extend(tokens)
            result.width += 1
            row.output.extend(token.token for token in tokens)
            if spec.idle >= IDLE_CHECKS or spec.acceptance.mean < floor:
                leaving.append(spec)
        self._leave(leaving)

    def _enter(self, rows: list[_BatchRow], result: LaneStep) -> None:
        """Rows leave the generator to speculate, each with one decided token to feed.

        A row that rejoined this step after a span brings the token it sampled there
        (reported, not fed). Otherwise its last token is in its cache already: a cache
        that trims gives it back, fed again so its logits check the first draft; a
        state cache cannot, so the token the generator already chose after it (greedy,
        read from the decoding batch) is reported now and fed first instead.
        """
        uids = [self._request_to_uid[row.row.request_id] for row in rows]
        fresh = [uid for uid, row in zip(uids, rows) if row.row.request_id not in self._echo]
        chosen = {} if self._trims or not fresh else next_inputs(self._generator, fresh)
        for row, uid, (cache, history) in zip(rows, uids, self._take_out(rows)):
            assert row.shadow is not None
            row.shadow.reset()
            grammar = row.grammar
            echoed = self._echo.pop(row.row.request_id, None)
            if echoed is not None:
                pending = echoed
            elif self._trims:
                for layer in cache:
                    layer.trim(1)
                history, pending = history[:-1], history[-1]
            else:
                pending = chosen[uid]
                try:
                    if grammar is not None:
                        grammar.consume(pending)
                except Exception as exc:  # the row's own grammar: it fails alone
                    row.failure = exc
                result.tokens.append(RowToken(row.row.request_id, pending, grammar_done=(
                    grammar is not None and row.failure is None and grammar.done)))
                row.output.append(pending)
            self._speculating[row.row.request_id] = SpeculatingRow(
                row.row, cache, history, pending, row.shadow.acceptance, trims=self._trims,
                grammar=grammar, words=self._compiler.words)

    def _shadow(self, row: _BatchRow) -> bool:
        """Shadow the row's drafts against what it decodes; True when it has a draft now."""
        request_id = row.row.request_id
        # A constrained row's draft starts with its forced tokens: with fast-forward off
        # (one token per step for constrained rows) it does not speculate either.
        constrained_ok = row.grammar is None or self.fast_forward
        if not (eligible(row.row) and constrained_ok and row.failure is None
                and request_id not in self._early and request_id in self._request_to_uid
                and decoding(self._generator, self._request_to_uid[request_id])):
            return False
        if row.shadow is None:
            row.shadow = ShadowDraft(DRAFT_TOKENS)
        return row.shadow.observe([*row.row.prompt, *row.output])

    def _leave(self, rows: list[SpeculatingRow]) -> None:
        """Speculating rows go back to the generator with what they have not fed."""
        for spec in rows:
            del self._speculating[spec.row.request_id]
            if spec.grammar is not None:
                spec.grammar.started = False  # its pending token is consumed already
        self._put_back([self._rows[spec.row.request_id] for spec in rows],
                       [spec.cache for spec in rows], [spec.history for spec in rows],
                       [spec.unfed for spec in rows])

    def _maybe_store_head(self, uid: int) -> None:
        request_id = self._uid_to_request.get(uid)
        key = self._planner.leader_head(request_id) if request_id is not None else None
        if key is None or request_id is None:
            return
        found = self._extract(request_id)
        if found is not None and len(found[1]) >= len(key):
            self.reuse.keep_prefix(found[1], found[0], len(key))
        self._head_stored(key)

    def _snapshot_prompt(self, uid: int) -> None:
        """Store a row's state at the end of its prompt (caches resumed only where a
        snapshot was taken): the next turn of its conversation starts with this prompt.
        Rows rejoining after a span or speculation also end a "prompt": not stored."""
        request_id = self._uid_to_request.get(uid)
        row = self._rows.get(request_id) if request_id is not None else None
        if row is None or row.generated > 0:
            return
        found = self._generator.extract_cache([uid]).get(uid)
        if found is not None and list(found[1]) == row.row.prompt:
            self.reuse.keep(found[1], found[0])
