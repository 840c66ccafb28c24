"""The batch lane's seam: decoding rows leave mlx-lm's generator and rejoin it.

Fast-forward and speculation feed a row several tokens outside the generator: they take it
out with its cache (``take_out``), and put it back with the tokens it decided but has not
fed (``put_back``). A row with one such token joins the decoding batch directly, fed by the
batch's next forward (``upstream.decoding_batch``); one with more goes through a prompt
segment, a forward of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from engine.device.rows.batch_row import BatchRow, BatchRows, OutRow
from engine.device.rows.row_cache import merged
from engine.device.upstream.decoding_batch import decoding, join_decoding, next_inputs, settle
from engine.requests.inbound.sampling import LogitsProcessor

# The generator must never end a row by length itself (engine.core.update decides).
NO_LIMIT = 1 << 62
NO_STOPS = StopSequences(None)


class GeneratorSeam:
    """Rows out of and back into the lane's generator; implements ``RowSeam``.

    ``generator``: the lane's current generator (a reset makes a new one); ``processors``: a
    row's logits processors as the lane builds them; ``direct_join``: False sends every
    rejoining row through a prompt segment.
    """

    def __init__(self, generator: Callable[[], BatchGenerator], rows: BatchRows,
                 processors: Callable[[BatchRow], list[LogitsProcessor]], stream: Any,
                 direct_join: bool = True) -> None:
        self._generator = generator
        self._rows = rows
        self._processors = processors
        self._stream = stream
        self.direct_join = direct_join

    def take_out(self, rows: Sequence[BatchRow]) -> list[OutRow]:
        """Remove decoding rows from the generator: each one's cache and the tokens it holds."""
        uids = [self._rows.left(row) for row in rows]
        taken = self._generator().remove(uids, return_prompt_caches=True)
        return [OutRow(row, list(taken[uid][0]), list(taken[uid][1]))
                for row, uid in zip(rows, uids)]

    def put_back(self, rows: Sequence[OutRow]) -> None:
        """Rows rejoin the generator from their caches; their ``unfed`` tokens go first.

        A row with one token to feed joins the decoding batch directly (its token is fed
        by the batch's next forward, and echoed back by the generator); one with more goes
        through a prompt segment.
        """
        generator = self._generator()
        direct = [out for out in rows if len(out.unfed) == 1]
        if direct and self.direct_join:
            with mx.stream(self._stream):
                uids = join_decoding(
                    generator, merged([out.cache for out in direct]),
                    [out.history for out in direct], [out.unfed[0] for out in direct],
                    [out.row.sampler for out in direct],
                    [self._processors(out.row) for out in direct], NO_STOPS, NO_LIMIT)
            for uid, out in zip(uids, direct):
                self._rows.joined(out.row, uid)
                out.row.echo = out.unfed[0]
            rows = [out for out in rows if len(out.unfed) != 1]
            # Evaluated now: the work is this step's, and span costs are measured per step
            # (left lazy, it landed in the next plain step, making spans look cheaper).
            settle(generator, self._stream)
        if not rows:
            return
        uids = generator.insert_segments(
            [[out.unfed] for out in rows],
            max_tokens=[NO_LIMIT] * len(rows),
            caches=[out.cache for out in rows],
            all_tokens=[out.history for out in rows],
            samplers=[out.row.sampler for out in rows],
            logits_processors=[self._processors(out.row) for out in rows],
            stop_sequences=[NO_STOPS] * len(rows),
        )
        for uid, out in zip(uids, rows):
            self._rows.joined(out.row, uid)

    def decoding(self, row: BatchRow) -> bool:
        return row.uid is not None and decoding(self._generator(), row.uid)

    def next_inputs(self, rows: Sequence[BatchRow]) -> list[tuple[int, Any]]:
        uids = [row.uid for row in rows if row.uid is not None]
        assert len(uids) == len(rows), "only rows in the generator have a next input"
        chosen = next_inputs(self._generator(), uids)
        return [chosen[uid] for uid in uids]
