"""The batch lane: every batchable row in one mlx-lm ``BatchGenerator``.

Rows are keyed by request id; the generator's own uids never leave this module and its
row records (``batch_row``). The generator is given no stop sequences and no length limit
of its own, so it never ends a row: ``engine.core.update`` decides, and the loop calls
``remove``.

The lane inserts, removes and steps rows, and is the seam through which a row leaves the
generator and rejoins it (``RowSeam``). Around that:

- **prefill**: when admitted rows are given to the generator, in which groups and
  segments, and which share a stored head, is the pure ``PrefillPlanner``'s decision
  (``engine.core``), handed to the lane when it is built. The lane carries it out: before
  a row is prefilled its prompt is looked up in the prefix cache (stored entries and
  running rows), a head's leader stores the head at its segment's end, and the twins the
  planner held back start then.
- **first tokens**: a group's first tokens are read from its samplers in the step that
  samples them (``first_tokens``), one step before mlx-lm returns them, except for
  constrained rows, whose grammar learns of the token only in that next step.
- **fast-forward**: when a constrained row's grammar forces two or more tokens after the
  token just returned, the row leaves the generator with its cache, is fed the forced
  span in one forward (``forced_spans``), samples its next free token there, and rejoins
  the generator with that token as a one-token segment. A chain of choice, span, choice,
  span runs as several such forwards in the same step, up to ``_SPAN_ROUNDS``.
- **speculation**: while the lane holds at most ``speculation`` rows, greedy rows leave
  the generator and are decoded by ``speculation`` on their own caches, several tokens a
  step where prompt-lookup drafts are accepted; they rejoin when load rises or drafts miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine.core.drafts import ShadowDraft
from engine.core.lane import LaneRow, LaneStep, RowToken
from engine.core.prefill_planner import HeadKey, PrefillPlanner
from engine.device.batch_row import BatchRow, BatchRows, OutRow
from engine.device.first_tokens import FirstToken, SamplerTap
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
from engine.requests.constraints.grammar import GrammarCompiler
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


class BatchLane:
    """Continuous batching on mlx-lm's BatchGenerator; implements ``Lane`` and ``RowSeam``.

    ``planner``: the prefill policy (its group size and chunk size the generator's too).
    ``direct_join``: rows back from a span or speculation join the decoding batch directly
    where this mlx-lm allows it (``rejoin``); False sends them through a prompt segment.
    """

    def __init__(self, model: Any, stream: Any, compiler: GrammarCompiler,
                 samplers: SamplerCache, reuse: PrefixReuse,
                 planner: PrefillPlanner[BatchRow], *, max_batch: int,
                 max_kv_size: int | None, fast_forward: bool = True, speculation: int = 0,
                 direct_join: bool = True) -> None:
        self._model = model
        self._stream = stream
        self._compiler = compiler
        self._samplers = samplers
        self.reuse = reuse
        self._planner = planner
        self._options = dict(completion_batch_size=max_batch,
                             prefill_batch_size=planner.group_size,
                             prefill_step_size=planner.chunk, max_kv_size=max_kv_size)
        self._generator = self._new_generator()
        self._no_stops = StopSequences(None)
        self.rows = BatchRows()
        self._tap = SamplerTap()
        self.direct_join = direct_join
        # Both feed several tokens at once: every cache kind but quantized KV takes them.
        supported = spans_supported(model, max_kv_size)
        self.fast_forward = fast_forward and supported
        self.speculation = speculation if supported else 0
        self.asked = (fast_forward, speculation)  # the settings, for stats().speedups
        layers = make_prompt_cache(model, max_kv_size)
        self.cache_kinds = cache_kinds(layers)
        self.trims = trims_exactly(layers)

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(self._model, stream=self._stream, **self._options)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def generator(self) -> BatchGenerator:
        """The mlx-lm generator (for inspection: the lane alone drives it)."""
        return self._generator

    # ----- insert ------------------------------------------------------------------------

    def insert(self, rows: Sequence[LaneRow]) -> None:
        held = [BatchRow(row, head_len=row.head_len) for row in rows]
        for held_row in held:
            params = held_row.row.params
            if params.constraint is not None:
                held_row.grammar = self._compiler.row(params.constraint)
            self.rows.add(held_row)
        self._start(held)

    def _start(self, rows: list[BatchRow], *, joining: bool = False) -> None:
        """Queue rows with the planner; ``joining`` rows may join the group in flight."""
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
            self.rows.joined(row, uid)
            row.report_cached = True
            self._planner.started(row.request_id, sum(len(part) for part in segments))

    def _processors(self, row: BatchRow) -> list[LogitsProcessor]:
        processors = [guarded(row, p) for p in penalty_processors(row.row.params)]
        if row.grammar is not None:  # last: the mask applies to the final logits
            mask = GrammarMask(row.grammar, self._compiler.words)
            processors.append(guarded(row, grammar_processor(mask)))
        return processors

    def _prefill_plan(self, row: BatchRow) -> tuple[list[list[int]], list[Any] | None,
                                                    list[int]]:
        """(prompt segments to prefill, starting cache, tokens that cache holds)."""
        prompt, cache, reused = row.row.prompt, None, 0
        running = {r.request_id: r.prompt for r in self.rows.in_generator()}
        found = self.reuse.lookup(prompt, running, self._extract)
        if found is not None:
            cache, reused = found
        row.cached_tokens = reused
        return self._planner.segments(row, reused), cache, prompt[:reused]

    def _extract(self, request_id: int) -> tuple[list[Any], list[int]] | None:
        row = self.rows.get(request_id)
        if row is None or row.uid is None:
            return None
        found = self._generator.extract_cache([row.uid]).get(row.uid)
        if found is None:
            return None
        # Copied now, so the running batch's buffers are not pinned by a lazy slice.
        return copied(list(found[0])), list(found[1])

    def _head_stored(self, key: HeadKey) -> None:
        """The head's prefill ended (stored or abandoned): start the rows waiting on it."""
        waiting = self._planner.head_done(key)
        if waiting:
            self._start(waiting, joining=True)

    def _maybe_store_head(self, row: BatchRow) -> None:
        key = self._planner.leader_head(row.request_id)
        if key is None:
            return
        found = self._extract(row.request_id)
        if found is not None and len(found[1]) >= len(key):
            self.reuse.keep_prefix(found[1], found[0], len(key))
        self._head_stored(key)

    def _snapshot_prompt(self, row: BatchRow) -> None:
        """Store a row's state at the end of its prompt (caches resumed only where a
        snapshot was taken): the next turn of its conversation starts with this prompt.
        Rows rejoining after a span or speculation also end a "prompt": not stored."""
        if row.generated > 0 or row.uid is None:
            return
        found = self._generator.extract_cache([row.uid]).get(row.uid)
        if found is not None and list(found[1]) == row.row.prompt:
            self.reuse.keep(found[1], found[0])

    # ----- remove ------------------------------------------------------------------------

    def remove(self, request_ids: Sequence[int]) -> None:
        held = [self.rows.get(request_id) for request_id in request_ids]
        uids = [row.uid for row in held if row is not None and row.uid is not None]
        if uids:
            keep = self.reuse.enabled
            for cache, tokens in self._generator.remove(uids, return_prompt_caches=keep).values():
                self.reuse.keep(tokens, cache)
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        row = self.rows.forget(request_id)
        if row is None:
            return
        spec = row.speculating
        if spec is not None and self.reuse.enabled:
            self.reuse.keep(spec.history, spec.cache)
        if row.grammar is not None:
            row.grammar.close()
        released = self._planner.forget(row)  # a leader abandoned: a twin leads now
        if released:
            self._start(released, joining=True)

    def reset(self) -> list[int]:
        dropped = [row.request_id for row in self.rows]
        self._planner.reset()
        for row in self.rows:
            row.speculating = None  # its cache may hold the failed step's arrays: not kept
        for request_id in dropped:
            self._forget(request_id)
        self._generator = self._new_generator()
        return dropped

    # ----- step --------------------------------------------------------------------------

    def step(self) -> LaneStep:
        """One decode step for decoding rows plus one prefill chunk for prefilling rows;
        then the rows it produced tokens for go to fast-forward and speculation."""
        self._tap.arm()
        try:
            progress, responses = self._generator.next()
            firsts = self._first_tokens(progress, decoded=len(responses))
        finally:
            self._tap.disarm()
        result = LaneStep(width=len(responses))
        for prompt_response in progress:
            row = self.rows.of_uid(prompt_response.uid)
            if row is None:
                continue
            done, total = prompt_response.progress
            self._planner.progressed(row.request_id, total - done)
            if prompt_response.end_of_segment and not prompt_response.end_of_prompt:
                self._maybe_store_head(row)
            elif prompt_response.end_of_prompt and self.reuse.snapshots:
                self._snapshot_prompt(row)
        decoded = self._collect(responses, result)
        for row, first in firsts:
            self._planner.first_token(row.request_id)
            row.early = first.token
            row.output.append(first.token)
            result.tokens.append(RowToken(
                row.request_id, first.token,
                token_logprob(row.row.params, first.token, first.logprobs)))
        if self.fast_forward:
            self._fast_forward(result)
        if self.speculation:
            self._speculate(decoded, result)
        self._feed()  # the group ahead has its first tokens: the next one prefills now
        for row in self.rows:
            if row.failure is not None:
                result.failed[row.request_id] = row.failure
            if row.report_cached:
                row.report_cached = False
                result.cached_tokens[row.request_id] = row.cached_tokens
        self.reuse.tick()
        return result

    def _collect(self, responses: Sequence[Any], result: LaneStep) -> list[BatchRow]:
        """The generator's decoded tokens into ``result``; returns the rows that decoded.

        A token the lane reported already (a first token read early, a rejoined row's
        next input) is checked, not reported again: a mismatch ends that row.
        """
        decoded: list[BatchRow] = []
        for response in responses:
            row = self.rows.of_uid(response.uid)
            if row is None:
                continue
            self._planner.first_token(row.request_id)
            if row.failure is not None:
                continue
            token = int(response.token)
            if row.echo is not None:
                if row.echo != token:  # the joined row was fed something else: end it
                    row.failure = RuntimeError(f"rejoined with {row.echo}, fed {token}")
                row.echo = None
                continue
            if row.early is not None:
                if row.early != token:  # the tap's reading was wrong: say so, end the row
                    row.failure = RuntimeError(
                        f"first token read early as {row.early}, generated as {token}")
                row.early = None
                continue
            decoded.append(row)
            row.output.append(token)
            result.tokens.append(RowToken(
                row.request_id, token, token_logprob(row.row.params, token, response.logprobs),
                grammar_done=row.grammar is not None and row.grammar.done))
        return decoded

    def _first_tokens(self, progress: Sequence[Any],
                      decoded: int) -> list[tuple[BatchRow, FirstToken]]:
        """First tokens of the rows that left prefill in this step, where they can be read."""
        rows = [self.rows.of_uid(p.uid) for p in progress if p.end_of_prompt]
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
        starting: list[tuple[BatchRow, list[int]]] = []
        shortest = min_span(len(self.rows))
        for request_id, token in last.items():
            row = self.rows[request_id]
            if (row.grammar is None or row.failure is not None or token.grammar_done
                    or row.uid is None):
                continue
            span = row.grammar.forced(_budget(row))
            if len(span) >= shortest:
                starting.append((row, span))
        if not starting:
            return
        spanning = self.take_out([row for row, _ in starting])
        for out, (_, span) in zip(spanning, starting):
            _take_forced(out, span, result)
        active = [out for out in spanning if _goes_on(out.row)]
        for round_ in range(_SPAN_ROUNDS):
            if not active:
                break
            with mx.stream(self._stream):
                forward = forward_spans(self._model, [out.cache for out in active],
                                        [out.unfed for out in active])
            chained = []
            for i, out in enumerate(active):
                out.cache = forward.caches[i]
                out.history += out.unfed
                out.unfed = []
                if self._sample_after_span(out, forward.logits[i:i + 1], result):
                    row = out.row
                    assert row.grammar is not None
                    more = row.grammar.forced(_budget(row))
                    if len(more) >= shortest and round_ + 1 < _SPAN_ROUNDS:
                        _take_forced(out, more, result)
                        chained.append(out)
            active = [out for out in chained if _goes_on(out.row)]
        rejoining = [out for out in spanning if out.unfed]
        for out in rejoining:
            assert out.row.grammar is not None
            out.row.grammar.started = False  # its unfed tokens are consumed already
        self.put_back(rejoining)

    def _sample_after_span(self, out: OutRow, logits: mx.array, result: LaneStep) -> bool:
        """Sample the token after a span as mlx-lm would (penalties, mask, sampler)."""
        row = out.row
        grammar = row.grammar
        assert grammar is not None and row.sampler is not None
        params = row.row.params
        try:
            with mx.stream(self._stream):
                processors = penalty_processors(params)
                if processors:
                    context = mx.array(out.history)
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
        out.unfed = [token]
        row.output.append(token)
        result.tokens.append(RowToken(row.request_id, token, logprob,
                                      grammar_done=grammar.done))
        return not grammar.done

    # ----- speculation ------------------------------------------------------------------

    def _speculate(self, decoded: list[BatchRow], result: LaneStep) -> None:
        """At low load, greedy rows check prompt-lookup drafts outside the generator."""
        speculating = [row for row in self.rows if row.speculating is not None]
        if len(self.rows) > self.speculation:
            self._leave(speculating)
            return
        floor = ACCEPTANCE_FLOOR * len(self.rows)  # a bigger batch makes a row's step cheaper
        entering = [row for row in decoded if self._shadow(row)
                    and row.shadow is not None and row.shadow.acceptance.mean >= floor]
        if entering:
            self._enter(entering, result)
            speculating += entering
        leaving = []
        for row in speculating:
            spec = row.speculating
            assert spec is not None
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
                leaving.append(row)
        self._leave(leaving)

    def _enter(self, rows: list[BatchRow], result: LaneStep) -> None:
        """Rows leave the generator to speculate, each with one decided token to feed.

        A row that rejoined this step after a span brings the token it sampled there
        (reported, not fed). Otherwise its last token is in its cache already: a cache
        that trims gives it back, fed again so its logits check the first draft; a
        state cache cannot, so the token the generator already chose after it (greedy,
        read from the decoding batch) is reported now and fed first instead.
        """
        fresh = [row for row in rows if row.echo is None]
        chosen = ({} if self.trims or not fresh else
                  dict(zip((row.request_id for row in fresh), self.next_inputs(fresh))))
        for out in self.take_out(rows):
            row, cache, history = out.row, out.cache, out.history
            assert row.shadow is not None
            row.shadow.reset()
            grammar = row.grammar
            if row.echo is not None:
                pending, row.echo = row.echo, None
            elif self.trims:
                for layer in cache:
                    layer.trim(1)
                history, pending = history[:-1], history[-1]
            else:
                pending = chosen[row.request_id]
                try:
                    if grammar is not None:
                        grammar.consume(pending)
                except Exception as exc:  # the row's own grammar: it fails alone
                    row.failure = exc
                result.tokens.append(RowToken(row.request_id, pending, grammar_done=(
                    grammar is not None and row.failure is None and grammar.done)))
                row.output.append(pending)
            row.speculating = SpeculatingRow(
                row.row, cache, history, pending, row.shadow.acceptance, trims=self.trims,
                grammar=grammar, words=self._compiler.words)

    def _shadow(self, row: BatchRow) -> bool:
        """Shadow the row's drafts against what it decodes; True when it has a draft now."""
        # A constrained row's draft starts with its forced tokens: with fast-forward off
        # (one token per step for constrained rows) it does not speculate either.
        constrained_ok = row.grammar is None or self.fast_forward
        if not (eligible(row.row) and constrained_ok and row.failure is None
                and row.early is None and self.decoding(row)):
            return False
        if row.shadow is None:
            row.shadow = ShadowDraft(DRAFT_TOKENS)
        return row.shadow.observe([*row.row.prompt, *row.output])

    def _leave(self, rows: list[BatchRow]) -> None:
        """Speculating rows go back to the generator with what they have not fed."""
        out = []
        for row in rows:
            spec = row.speculating
            assert spec is not None
            row.speculating = None
            if spec.grammar is not None:
                spec.grammar.started = False  # its pending token is consumed already
            out.append(OutRow(row, spec.cache, spec.history, spec.unfed))
        self.put_back(out)

    # ----- the seam: rows leaving and rejoining the generator (``RowSeam``) ---------------

    def take_out(self, rows: Sequence[BatchRow]) -> list[OutRow]:
        """Remove decoding rows from the generator: each one's cache and the tokens it holds."""
        uids = [self.rows.left(row) for row in rows]
        taken = self._generator.remove(uids, return_prompt_caches=True)
        return [OutRow(row, list(taken[uid][0]), list(taken[uid][1]))
                for row, uid in zip(rows, uids)]

    def put_back(self, rows: Sequence[OutRow]) -> None:
        """Rows rejoin the generator from their caches; their ``unfed`` tokens go first.

        A row with one token to feed joins the decoding batch directly (its token is fed
        by the batch's next forward, and echoed back by the generator); one with more goes
        through a prompt segment.
        """
        direct = [out for out in rows if len(out.unfed) == 1]
        if direct and self.direct_join and direct_join_supported(self._generator):
            with mx.stream(self._stream):
                uids = join_decoding(
                    self._generator, [out.cache for out in direct],
                    [out.history for out in direct], [out.unfed[0] for out in direct],
                    [out.row.sampler for out in direct],
                    [self._processors(out.row) for out in direct], self._no_stops, _NO_LIMIT)
            for uid, out in zip(uids, direct):
                self.rows.joined(out.row, uid)
                out.row.echo = out.unfed[0]
            rows = [out for out in rows if len(out.unfed) != 1]
        if not rows:
            return
        uids = self._generator.insert_segments(
            [[out.unfed] for out in rows],
            max_tokens=[_NO_LIMIT] * len(rows),
            caches=[out.cache for out in rows],
            all_tokens=[out.history for out in rows],
            samplers=[out.row.sampler for out in rows],
            logits_processors=[self._processors(out.row) for out in rows],
            stop_sequences=[self._no_stops] * len(rows),
        )
        for uid, out in zip(uids, rows):
            self.rows.joined(out.row, uid)

    def decoding(self, row: BatchRow) -> bool:
        return row.uid is not None and decoding(self._generator, row.uid)

    def next_inputs(self, rows: Sequence[BatchRow]) -> list[int]:
        uids = [row.uid for row in rows if row.uid is not None]
        assert len(uids) == len(rows), "only rows in the generator have a next input"
        chosen = next_inputs(self._generator, uids)
        return [chosen[uid] for uid in uids]


def _goes_on(row: BatchRow) -> bool:
    """A row still decoding after its span: not failed, its grammar not complete."""
    return row.failure is None and row.grammar is not None and not row.grammar.done


def _budget(row: BatchRow) -> int:
    """Forced tokens the row may still take, leaving room for the token sampled after."""
    return row.row.params.max_tokens - row.generated - 1


def _take_forced(out: OutRow, span: list[int], result: LaneStep) -> None:
    """The span's tokens are certain: consume and report them now, feed them next."""
    row = out.row
    assert row.grammar is not None
    params = row.row.params
    for token in span:
        try:
            row.grammar.consume(token)
        except Exception as exc:  # the row's own grammar: it fails alone
            row.failure = exc
            return
        out.unfed.append(token)
        row.output.append(token)
        result.tokens.append(RowToken(row.request_id, token, forced_logprob(params, token),
                                      grammar_done=row.grammar.done, forced=True))
