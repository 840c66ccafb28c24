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
- **images**: a row whose prompt holds images is prefilled first by ``VisionPrefill`` (in
  units a step's credit pays for) into its own cache, then handed to the generator like a
  resumed prefix.
  Prefix reuse keys its tokens by its images (``BatchRow.keyed``).
- **fast-forward** (``ForcedSpanRunner``) and **speculation** (``Speculator``) are handed
  each step's rows; they take rows out through the seam, feed them several tokens, and
  put them back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine.core.lane import LaneCapabilities, LaneRow, LaneStep, RowToken
from engine.core.prefill_planner import HeadKey, PrefillPlanner
from engine.core.step_costs import StepCosts
from engine.device.adapters.row_adapters import adapters_of, routed
from engine.device.lane.decoded_tokens import collect_decoded, first_tokens
from engine.device.lane.generator_seam import NO_LIMIT, NO_STOPS, GeneratorSeam
from engine.device.prefix.prefix_reuse import PrefixReuse
from engine.device.rows.batch_row import BatchRow, BatchRows
from engine.device.rows.first_tokens import SamplerTap
from engine.device.rows.grammar_step import GrammarProcessor, MaskFiller
from engine.device.rows.logprobs import token_logprobs
from engine.device.rows.row_cache import copied, trims_exactly
from engine.device.rows.sampling import GrammarMask, SamplerCache, guarded, penalty_processors
from engine.device.speedups.forced_span_runner import ForcedSpanRunner
from engine.device.speedups.forced_spans import spans_supported
from engine.device.speedups.forward_probe import forward_cost
from engine.device.speedups.report import cache_kinds
from engine.device.speedups.speculator import Speculator
from engine.device.upstream.batches import install
from engine.device.vision.prefill import VisionPrefill
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.inbound.sampling import LogitsProcessor


class BatchLane:
    """Continuous batching on mlx-lm's BatchGenerator; implements ``Lane`` (its ``seam``
    implements ``RowSeam``).

    ``planner``: the prefill policy (its group size and chunk size the generator's too).
    ``direct_join``: rows back from a span or speculation join the decoding batch directly
    (``upstream.decoding_batch``); False sends them through a prompt segment.
    ``measured_costs``: False where every rank of a sharded engine runs this lane: spans and
    checks are then decided by fixed thresholds, alike on every rank (``StepCosts``).
    """

    def __init__(self, model: Any, stream: Any, compiler: GrammarCompiler,
                 samplers: SamplerCache, reuse: PrefixReuse,
                 planner: PrefillPlanner[BatchRow], *, max_batch: int,
                 max_kv_size: int | None, fast_forward: bool = True, speculation: int = 0,
                 direct_join: bool = True, vision: VisionPrefill | None = None,
                 vision_share: float = 0.08, measured_costs: bool = True) -> None:
        self._model = model
        self._stream = stream
        self._compiler = compiler
        self._samplers = samplers
        self.reuse = reuse
        self._planner = planner
        self._options = dict(completion_batch_size=max_batch,
                             prefill_batch_size=planner.group_size,
                             prefill_step_size=planner.chunk, max_kv_size=max_kv_size)
        self.masks = MaskFiller(compiler.words)
        self.adapters = adapters_of(model)  # per-row LoRA adapters (``row_adapters``)
        self.vision = vision  # image rows' own prefill; None for a text-only model
        self.vision_share = vision_share  # of a decode step, image work's while rows decode
        self.capabilities = LaneCapabilities(images=vision is not None,
                                             adapters=self.adapters is not None)
        self._width = 0  # rows the last step decoded
        self._generator = self._new_generator()
        self.rows = BatchRows(self.adapters.uid_slots if self.adapters is not None else None)
        self._tap = SamplerTap()
        # Rows leave the generator and rejoin it here (fast-forward, speculation).
        self.seam = GeneratorSeam(lambda: self._generator, self.rows, self._processors, stream,
                                  direct_join)
        # Both feed several tokens at once: every cache kind but quantized KV takes them.
        supported = spans_supported(model, max_kv_size)
        self.fast_forward = fast_forward and supported
        self.speculation = speculation if supported else 0
        self.asked = (fast_forward, speculation)  # the settings, for stats().speedups
        layers = make_prompt_cache(model, max_kv_size)
        self.cache_kinds = cache_kinds(layers)
        self.trims = trims_exactly(layers)
        words = compiler.words
        # Steps, spans and checks as measured here: what fast-forward and speculation decide by.
        # Before any is measured, a forward timed at the first span decision prices them
        # (not on a sharded lane's ranks, which must decide alike).
        self.costs = StepCosts(measured_costs, partial(forward_cost, model, stream, max_kv_size)
                               if self.fast_forward or self.speculation else None)
        self.forced_spans: ForcedSpanRunner | None = (
            ForcedSpanRunner(model, stream, self.seam, words, self.costs) if self.fast_forward
            else None)
        self.speculator: Speculator | None = (
            Speculator(model, stream, self.seam, words, limit=self.speculation, trims=self.trims,
                       constrained=self.fast_forward, costs=self.costs)
            if self.speculation else None)

    def _new_generator(self) -> BatchGenerator:
        generator = BatchGenerator(self._model, stream=self._stream, **self._options)
        # Constrained rows masked together while the forward runs (``grammar_step``), and
        # each row's adapter in every forward (``row_adapters``): the seam's subclasses.
        install(generator, self.masks, routed)
        return generator

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
            if params.adapter is not None:
                self._hold_adapter(held_row, params.adapter)
        held = [row for row in held if row.failure is None]
        self._start([row for row in held if not row.row.images or not self._to_vision(row)])

    def accepts(self, row: LaneRow) -> str | None:
        return self.capabilities.refusal(row)

    def _hold_adapter(self, row: BatchRow, path: str) -> None:
        """Load (once) and hold the row's adapter; one that cannot load fails the row."""
        assert self.adapters is not None, "StepCore refuses adapter rows here (accepts)"
        try:
            row.adapter, row.slot = self.adapters.acquire(path)
        except Exception as exc:  # a bad adapter fails its row alone
            row.failure = exc

    def _to_vision(self, row: BatchRow) -> bool:
        """Queue an image row's own prefill, resuming the longest cached prefix of its
        keyed prompt; False when that prefix covers every image (it starts at once)."""
        assert self.vision is not None, "StepCore refuses image rows here (accepts)"
        found, frame = None, row.row.position_shift
        running = self._running_keyed()
        for frame in row.resume_frames():  # its own shift, then an earlier turn's
            found = self.reuse.lookup(row.keyed_at(row.prompt, frame), running,
                                      self._extract)
            if found is not None:
                break
        cache, reused = found if found is not None else (None, 0)
        if (cache is not None and reused >= row.row.vision_end
                and frame == row.row.position_shift):
            row.vision_ready = (cache, reused)
            return False
        self.vision.add(row, cache, reused, frame if cache is not None else 0)
        return True

    def _running_keyed(self) -> dict[int, list[int]]:
        return {r.request_id: r.keyed(r.prompt) for r in self.rows.in_generator()}

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
            max_tokens=[NO_LIMIT] * len(ready),
            caches=[plan[1] for plan in plans],
            all_tokens=[plan[2] for plan in plans],
            samplers=[row.sampler for row in ready],
            logits_processors=[self._processors(row) for row in ready],
            stop_sequences=[NO_STOPS] * len(ready),
        )
        for uid, row, (segments, *_) in zip(uids, ready, plans):
            self.rows.joined(row, uid)
            row.report_cached = True
            self._planner.started(row.request_id, sum(len(part) for part in segments))

    def _processors(self, row: BatchRow) -> list[LogitsProcessor]:
        processors = [guarded(row, p) for p in penalty_processors(row.row.params)]
        if row.grammar is not None:  # last: the mask applies to the final logits
            processors.append(GrammarProcessor(row, GrammarMask(row.grammar,
                                                                 self._compiler.words)))
        return processors

    def _prefill_plan(self, row: BatchRow) -> tuple[list[list[int]], list[Any] | None,
                                                    list[int]]:
        """(prompt segments to prefill, starting cache, tokens that cache holds)."""
        prompt, cache, reused = row.row.prompt, None, 0
        if row.vision_ready is not None:  # an image row's own prefill (or a cached one)
            (cache, reused), row.vision_ready = row.vision_ready, None
            found = None
        else:
            found = self.reuse.lookup(row.keyed(prompt), self._running_keyed(),
                                      self._extract)
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
        return copied(list(found[0])), row.keyed(list(found[1]))

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
            self.reuse.keep(row.keyed(row.prompt), found[0])

    # ----- remove ------------------------------------------------------------------------

    def remove(self, request_ids: Sequence[int]) -> None:
        held = [self.rows.get(request_id) for request_id in request_ids]
        uids = [row.uid for row in held if row is not None and row.uid is not None]
        if uids:
            keep = self.reuse.enabled
            removed = self._generator.remove(uids, return_prompt_caches=keep)
            for row in held:
                if row is not None and row.uid in removed:
                    cache, tokens = removed[row.uid]
                    self.reuse.keep(row.keyed(list(tokens)), cache)
        released: list[BatchRow] = []
        for request_id in request_ids:
            if self.vision is not None:
                self.vision.drop(request_id)
            released += self._forget(request_id)
        # Twins an abandoned leader released start once every row of this removal is gone:
        # started earlier, one removed with it would join the generator and stay there.
        leaving = set(request_ids)
        released = [row for row in released if row.request_id not in leaving]
        if released:
            self._start(released, joining=True)

    def _forget(self, request_id: int) -> list[BatchRow]:
        """Drop the row and what it held; returns the twins its abandoned head released."""
        row = self.rows.forget(request_id)
        if row is None:
            return []
        spec = row.speculating
        if spec is not None and self.reuse.enabled:
            self.reuse.keep(row.keyed(list(spec.history)), spec.cache)
        if row.grammar is not None:
            row.grammar.close()
        if row.adapter is not None and self.adapters is not None:
            self.adapters.release(row.adapter)
        return self._planner.forget(row)  # a leader abandoned: a twin leads now

    def reset(self) -> list[int]:
        dropped = list(self.rows.by_request)
        self._planner.reset()
        if self.vision is not None:
            self.vision.clear()
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
        if self.vision is not None and len(self.vision):
            self._advance_vision()
        started = time.perf_counter()  # the decode step's own time: image work is not in it
        self._tap.arm()
        try:
            progress, responses = self._generator.next()
            firsts = first_tokens(progress, self.rows, self._tap, decoded=len(responses))
        finally:
            self._tap.disarm()
        result = LaneStep(width=len(responses))
        self._width = result.width
        by_uid = self.rows.by_uid
        for prompt_response in progress:
            row = by_uid.get(prompt_response.uid)
            if row is None:
                continue
            done, total = prompt_response.progress
            self._planner.progressed(row.request_id, total - done)
            if prompt_response.end_of_segment and not prompt_response.end_of_prompt:
                self._maybe_store_head(row)
            elif prompt_response.end_of_prompt and self.reuse.snapshots:
                self._snapshot_prompt(row)
        sampled: list[tuple[BatchRow, int, Any]] = []  # row, token, the logits it read
        decoded = collect_decoded(responses, self.rows, self._planner.first_token, sampled)
        for row, first in firsts:
            self._planner.first_token(row.request_id)
            row.early = first.token
            sampled.append((row, first.token, first.logprobs))
        # Every asking row's logprobs in one read of the device (not one per row).
        logprobs = token_logprobs([row.row.params for row, _, _ in sampled],
                                  [token for _, token, _ in sampled],
                                  [values for _, _, values in sampled])
        for (row, token, _), logprob in zip(sampled, logprobs):
            row.output.append(token)
            done = row.grammar is not None and row.grammar.done  # first tokens: no grammar
            result.tokens.append(RowToken(row.request_id, token, logprob, grammar_done=done))
        if self.vision is not None and progress:
            self._charge_joins(progress, result.width, time.perf_counter() - started)
        if self.forced_spans is not None:
            self.forced_spans.run(self.rows, result)
        if (self.forced_spans is not None or self.speculator is not None
                or self.vision is not None) and not (progress or firsts):
            # A decode step's own time (before any speculation check), with or without
            # spans; steps that also prefilled say nothing about either decision.
            forced = sum(token.forced for token in result.tokens)
            self.costs.timed(result.width, forced, time.perf_counter() - started)
        if self.speculator is not None:
            self.speculator.run(self.rows, decoded, result)
        self._feed()  # the group ahead has its first tokens: the next one prefills now
        for row in self.rows:
            if row.failure is not None:
                result.failed[row.request_id] = row.failure
            if row.report_cached:
                row.report_cached = False
                result.cached_tokens[row.request_id] = row.cached_tokens
        self.reuse.tick()
        return result

    def _charge_joins(self, progress: Sequence[Any], width: int, seconds: float) -> None:
        """Charge image rows' joins to the image credit.

        An image row joins like a resumed prefix: mlx-lm prefills the text after its image
        in a prompt batch, samples its first token and merges its cache into the decoding
        batch, all inside a decode step the text rows wait for. What this step took past
        a plain step of its width is image work too: the image rows' part of it is paid
        from the credit, so the decoding rows keep ``1/(1 + vision_share)`` of their pace
        with the joins counted (uncharged, four rows joining cost a tiny model's text rows
        about 2% more).
        """
        assert self.vision is not None
        plain = self.costs.step_near(width) if width else None
        if plain is None or seconds <= plain:
            return
        by_uid = self.rows.by_uid
        joining = [by_uid.get(response.uid) for response in progress]
        images = sum(1 for row in joining if row is not None and row.row.images)
        if images:
            self.vision.schedule.spent((seconds - plain) * images / len(joining))

    def _advance_vision(self) -> None:
        """Image prefill for this step; a row whose prefill is done starts in the batch.

        While rows decode, each step earns it ``vision_share`` of a decode step's measured
        time (of the nearest width measured; until one is, a unit a step); with none
        decoding, it runs to the end of every job."""
        assert self.vision is not None
        budget = self.costs.image_budget(self._width, self.vision_share)
        done, failed = self.vision.advance(budget)
        for request_id, exc in failed.items():
            row = self.rows.get(request_id)
            if row is not None:
                row.failure = exc
        ready = []
        for job in done:
            job.row.vision_ready = (job.cache, job.done)
            ready.append(job.row)
        if ready:
            self._start(ready)
