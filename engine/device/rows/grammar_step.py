"""The decoding batch's grammar masks, filled while its forward runs, applied in one op.

mlx-lm applies logits processors row by row: each constrained row read its last token
(a device sync), filled its own mask and masked its own slice of the logits, in series
with the forward, and any processor in the batch made every row a slice and a concat.
Here the decoding batch's constrained rows are masked together:

- the step's forward is built and queued, then the host waits once for the tokens the
  last step sampled; the matchers consume them and llguidance fills every constrained
  row's bitmask on its own threads (the GIL released) while the device runs the forward;
- the bitmask is unpacked on the device and one ``where`` masks every row; rows without a
  grammar are all-allowed.

No Python worker thread: it would hold the GIL the engine thread needs back after each
MLX call (measured: 0.79-0.83 of plain rows' tok/s with one, 0.90-0.95 without, 16 rows
all constrained in the host regime).

The step itself is mlx-lm's, re-done in the upstream seam (``upstream.batches``), which
asks ``MaskFiller`` for the masks. A group's first step runs in mlx-lm's own batch before it
joins: its rows use the per-row path (``GrammarProcessor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.device.rows.sampling import FailureSlot, GrammarMask
from engine.requests.constraints.grammar import RowGrammar, fill_rows


class GrammarProcessor:
    """A constrained row's logits processor (mlx-lm's ``(tokens, logits) -> logits``).

    Run by mlx-lm (a group's first step) it advances the row's matcher by the last token
    and masks the row alone; in the lane's decoding batch it is a marker, and
    ``MaskFiller`` does the same work for every such row at once. A failure fails the
    row only (recorded on ``slot``; its logits pass unmasked, and the lane ends it).
    """

    def __init__(self, slot: FailureSlot, mask: GrammarMask) -> None:
        self.slot = slot
        self.mask = mask

    @property
    def grammar(self) -> RowGrammar:
        return self.mask.grammar

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.slot.failure is not None:
            return logits
        try:
            grammar = self.grammar
            if grammar.started:
                last: int = tokens[-1].item()  # type: ignore[assignment]
                grammar.consume(last)
            grammar.started = True
            return self.mask.apply(logits)
        except Exception as exc:  # reported to that row's consumer by the lane
            self.slot.failure = exc
            return logits


class MaskFiller:
    """Advances a batch's matchers and fills their masks in one parallel call.

    Runs on the engine thread: the matchers consume the last step's tokens (a few
    microseconds a row), then llguidance fills every row's bitmask on its own threads with
    the GIL released, while the device runs the step's forward. No Python worker: one
    would hold the GIL the engine thread needs back after each MLX call (a 5 ms switch
    interval at worst, measured as 2 ms a step at 16 rows).
    """

    def __init__(self, words: int, threads: int | None = None) -> None:
        self._words = words
        self._threads = threads
        self._executor: Any = None  # made at the first constrained step: text rows start none
        self._shifts = mx.arange(32, dtype=mx.uint32)

    def batched(self, processors: Sequence[Any]) -> list[tuple[int, Any]]:
        """(batch index, processor) of the decoding batch's constrained rows."""
        return [(index, processor) for index, row in enumerate(processors)
                for processor in (row or ()) if isinstance(processor, GrammarProcessor)]

    def started(self, rows: Sequence[tuple[int, Any]]) -> bool:
        """Whether any row's grammar needs the last step's token."""
        return any(processor.grammar.started for _, processor in rows)

    def others(self, processors: Any) -> list[Any]:
        """A row's processors other than its grammar (penalties, a caller's own)."""
        return [p for p in (processors or ()) if not isinstance(p, GrammarProcessor)]

    def fill(self, rows: Sequence[tuple[int, Any]], tokens: list[int] | None,
             width: int, vocab: int) -> mx.array | None:
        """The batch's (``width``, ``vocab``) allowed-token mask; ``tokens`` by batch row.

        None when every constrained row failed (their failures are on their slots).
        """
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._threads)
        bitmask = np.full((width, self._words), -1, dtype=np.int32)
        live: list[tuple[RowGrammar, int]] = []
        slots: dict[int, FailureSlot] = {}
        for index, processor in rows:
            slot, grammar = processor.slot, processor.grammar
            if slot.failure is not None:
                continue
            try:
                if grammar.started:
                    assert tokens is not None, "a started grammar's token was not read"
                    grammar.consume(tokens[index])
                grammar.started = True
            except Exception as exc:
                slot.failure = exc
                continue
            live.append((grammar, index))
            slots[index] = slot
        if not live:
            return None
        for index, failure in fill_rows(self._executor, live, bitmask).items():
            slots[index].failure = failure
            bitmask[index] = -1
        # Unpacked on the device: 4 bytes a 32 tokens cross, not one byte a token.
        words = mx.array(bitmask.view(np.uint32))
        bits = (words[:, :, None] >> self._shifts) & 1
        return bits.reshape(width, -1)[:, :vocab].astype(mx.bool_)
