"""Speculation for the batch lane: which rows leave mlx-lm's generator to check drafts.

While the lane holds at most ``limit`` rows, a greedy row whose drafts have been right
often enough (compared, at no cost, with what it decoded: ``ShadowDraft``) leaves the
generator with its cache (``RowSeam.take_out``) and is decoded by ``speculation`` on its
own, several tokens a step where prompt-lookup drafts are accepted. It rejoins the
generator (``RowSeam.put_back``) when load rises, its drafts run dry or stop paying.
A speculating row's state is its record's ``speculating``; the speculator holds none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.core.drafts import ShadowDraft
from engine.core.lane import LaneStep, RowToken
from engine.core.step_costs import StepCosts
from engine.device.adapters.row_adapters import rows_of
from engine.device.rows.batch_row import BatchRow, BatchRows, OutRow, RowSeam
from engine.device.rows.logprobs import token_logprob
from engine.device.rows.speculating_row import SpeculatingRow
from engine.device.speedups.speculation import (
    ACCEPTANCE_FLOOR,
    DRAFT_TOKENS,
    IDLE_CHECKS,
    eligible,
    speculate,
)

# One speculating row's step: (model, row, budget) -> the tokens it produced.
Check = Callable[[Any, SpeculatingRow, int], list[RowToken]]


@dataclass(frozen=True)
class SpeculationPolicy:
    """When a row's drafts pay: ``acceptance_floor`` accepted tokens per draft per row in
    the lane to enter or stay; back to the generator after ``idle_checks`` draftless steps."""

    acceptance_floor: float = ACCEPTANCE_FLOOR
    idle_checks: int = IDLE_CHECKS


@dataclass(frozen=True)
class Speculator:
    """Moves rows between the generator and speculation; the lane hands it each step's
    decoded rows. ``check`` is one speculating row's step (``speculation.speculate``)."""

    model: Any
    stream: Any  # the engine thread's MLX stream
    seam: RowSeam
    words: int  # the grammar bitmask's width (32-bit words)
    limit: int  # rows speculate only while the lane holds at most this many
    trims: bool  # the model's caches trim exactly (else rejected drafts are rolled back)
    # A constrained row's draft starts with its forced tokens: with fast-forward off (one
    # token per step for constrained rows) it does not speculate either.
    constrained: bool = True
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    check: Check = speculate
    # Measured step and check times (shared with fast-forward): once checks are timed, the
    # acceptance a row needs is what pays on this device and batch, not the fixed floor.
    costs: StepCosts | None = None

    def _floor(self, rows: int, decoding: int) -> float:
        """Accepted tokens per draft a row needs, beside ``decoding`` rows in the batch."""
        if self.costs is None:
            return self.policy.acceptance_floor * rows  # a bigger batch makes a step cheaper
        return self.costs.acceptance_needed(rows, decoding, self.policy.acceptance_floor)

    def run(self, rows: BatchRows, decoded: Sequence[BatchRow], result: LaneStep) -> None:
        """At low load, greedy rows check prompt-lookup drafts outside the generator.

        ``decoded``: the rows whose token came from the generator's decode this step.
        """
        speculating = [row for row in rows if row.speculating is not None]
        if len(rows) > self.limit:
            self.leave(speculating)
            return
        # ``decoded`` rows step in the batch now; a row entering leaves it.
        entry = self._floor(len(rows), max(0, len(decoded) - 1))
        floor = self._floor(len(rows), len(decoded))
        entering = [row for row in decoded if self._drafting(row)
                    and row.shadow is not None and row.shadow.acceptance.mean >= entry]
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
            started = time.perf_counter()
            try:
                with mx.stream(self.stream), rows_of(self.model, [row.slot]):
                    tokens = self.check(self.model, spec, budget)
            except Exception as exc:  # the row's own grammar: it fails alone
                row.failure = exc
                continue
            if self.costs is not None:
                self.costs.checked(time.perf_counter() - started)
            result.tokens.extend(tokens)
            result.width += 1
            row.output.extend(token.token for token in tokens)
            if spec.idle >= self.policy.idle_checks or spec.acceptance.mean < floor:
                leaving.append(row)
        self.leave(leaving)

    def leave(self, rows: Sequence[BatchRow]) -> None:
        """Speculating rows go back to the generator with what they have not fed."""
        out = []
        for row in rows:
            spec = row.speculating
            assert spec is not None
            row.speculating = None
            if spec.grammar is not None:
                spec.grammar.started = False  # its pending token is consumed already
            out.append(OutRow(row, spec.cache, spec.history, spec.unfed))
        self.seam.put_back(out)

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
                  dict(zip((row.request_id for row in fresh), self.seam.next_inputs(fresh))))
        for out in self.seam.take_out(rows):
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
                pending, logprobs = chosen[row.request_id]
                try:
                    if grammar is not None:
                        grammar.consume(pending)
                except Exception as exc:  # the row's own grammar: it fails alone
                    row.failure = exc
                result.tokens.append(RowToken(
                    row.request_id, pending, token_logprob(row.row.params, pending, logprobs),
                    grammar_done=grammar is not None and row.failure is None and grammar.done))
                row.output.append(pending)
            row.speculating = SpeculatingRow(
                row.row, cache, history, pending, row.shadow.acceptance, trims=self.trims,
                grammar=grammar, words=self.words)

    def _drafting(self, row: BatchRow) -> bool:
        """Shadow the row's drafts against what it decodes; True when it has a draft now."""
        constrained_ok = row.grammar is None or self.constrained
        if not (eligible(row.row) and constrained_ok and row.failure is None
                and row.early is None and self.seam.decoding(row)):
            return False
        if row.shadow is None:
            row.shadow = ShadowDraft(DRAFT_TOKENS)
        return row.shadow.observe([*row.row.prompt, *row.output])
