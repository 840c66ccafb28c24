"""Grammar fast-forward for the batch lane: forced spans fed outside mlx-lm's generator.

When a constrained row's grammar forces two or more tokens after the token the step just
produced, the row leaves the generator with its cache (``RowSeam.take_out``), is fed the
forced span in one forward (``forced_spans``), samples its next free token there exactly
as mlx-lm would (penalties, grammar mask, its own sampler), and rejoins the generator with
that token still to feed (``RowSeam.put_back``). A chain of choice, span, choice, span
runs as several such forwards in the same step, up to ``rounds``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.core.lane import LaneStep, RowToken
from engine.core.step_costs import StepCosts, min_span
from engine.device.adapters.row_adapters import rows_of
from engine.device.rows.batch_row import BatchRow, BatchRows, OutRow, RowSeam
from engine.device.rows.logprobs import forced_logprob, token_logprob
from engine.device.rows.sampling import GrammarMask, penalty_processors
from engine.device.speedups.forced_spans import forward_spans

# Rounds bound how long one step may be held by span forwards.
SPAN_ROUNDS = 4


@dataclass(frozen=True)
class ForcedSpanRunner:
    """Feeds rows their grammar's forced spans; the lane hands it each step's tokens.

    ``costs``: what steps and spans measure on this device, which decides whether the
    rows reaching a span take it; ``shortest(rows)``: the shortest span a row already out
    chains, with ``rows`` in the lane; ``rounds``: span forwards a row may chain in a step.
    """

    model: Any
    stream: Any  # the engine thread's MLX stream
    seam: RowSeam
    words: int  # the grammar bitmask's width (32-bit words)
    costs: StepCosts
    shortest: Callable[[int], int] = min_span
    rounds: int = SPAN_ROUNDS

    def run(self, rows: BatchRows, result: LaneStep) -> None:
        """Rows whose grammar now forces a span: feed it at once if its measured cost is
        below the steps it saves (``costs``), sample, rejoin."""
        last: dict[int, RowToken] = {token.request_id: token for token in result.tokens}
        starting: list[tuple[BatchRow, list[int]]] = []
        shortest = self.shortest(len(rows))
        by_request = rows.by_request
        for request_id, token in last.items():
            row = by_request[request_id]
            if (row.grammar is None or row.failure is not None or token.grammar_done
                    or row.uid is None):
                continue
            span = row.grammar.forced(_budget(row))
            if len(span) >= 2:
                starting.append((row, span))
        least = self.costs.shortest([len(span) for _, span in starting], result.width,
                                    len(rows))
        starting = [(row, span) for row, span in starting if len(span) >= least]
        if not starting:
            return
        spanning = self.seam.take_out([row for row, _ in starting])
        for out, (_, span) in zip(spanning, starting):
            _take_forced(out, span, result)
        active = [out for out in spanning if _goes_on(out.row)]
        for round_ in range(self.rounds):
            if not active:
                break
            with mx.stream(self.stream), rows_of(self.model, [o.row.slot for o in active]):
                forward = forward_spans(self.model, [out.cache for out in active],
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
                    if len(more) >= shortest and round_ + 1 < self.rounds:
                        _take_forced(out, more, result)
                        chained.append(out)
            active = [out for out in chained if _goes_on(out.row)]
        self._rejoin(spanning)

    def _sample_after_span(self, out: OutRow, logits: mx.array, result: LaneStep) -> bool:
        """Sample the token after a span as mlx-lm would (penalties, mask, sampler)."""
        row = out.row
        grammar = row.grammar
        assert grammar is not None and row.sampler is not None
        params = row.row.params
        try:
            with mx.stream(self.stream):
                processors = penalty_processors(params)
                if processors:
                    context = mx.array(out.history)
                    for processor in processors:
                        logits = processor(context, logits)
                logits = GrammarMask(grammar, self.words).apply(logits)
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

    def _rejoin(self, spanning: list[OutRow]) -> None:
        """Hand fast-forwarded rows back to the generator with their undecoded tokens; a
        row that failed before anything was decided is not handed back (it ends now)."""
        rows = [out for out in spanning if out.unfed]
        for out in rows:
            assert out.row.grammar is not None
            out.row.grammar.started = False  # its unfed tokens are consumed already
        self.seam.put_back(rows)


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
