"""The tokens a lane step hands its rows: decoded by mlx-lm's generator, or read early.

mlx-lm returns a group's first tokens one step after it samples them; the lane reads them in
the step that samples them (``first_tokens``, through the ``SamplerTap``). A token the lane
reported already (a first token read early, a rejoined row's next input) comes back from
the generator a step later: ``collect_decoded`` checks it instead of reporting it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.device.rows.batch_row import BatchRow, BatchRows
from engine.device.rows.first_tokens import FirstToken, SamplerTap


def collect_decoded(responses: Sequence[Any], rows: BatchRows,
                    first_token: Callable[[int], None],
                    sampled: list[tuple[BatchRow, int, Any]]) -> list[BatchRow]:
        """The generator's decoded tokens into ``sampled`` (row, token, the logits it was
        read from); returns the rows that decoded.

        A token the lane reported already (a first token read early, a rejoined row's
        next input) is checked, not reported again: a mismatch ends that row.
        """
        decoded: list[BatchRow] = []
        by_uid = rows.by_uid
        for response in responses:
            row = by_uid.get(response.uid)
            if row is None:
                continue
            first_token(row.request_id)
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
            sampled.append((row, token, response.logprobs))
        return decoded


def first_tokens(progress: Sequence[Any], held: BatchRows, tap: SamplerTap,
                 decoded: int) -> list[tuple[BatchRow, FirstToken]]:
        """First tokens of the rows that left prefill in this step, where they can be read."""
        rows = [held.of_uid(p.uid) for p in progress if p.end_of_prompt]
        group = [row for row in rows if row is not None and row.sampler is not None]
        if not group or len(group) != len(rows):
            return []
        firsts = tap.group_tokens([row.sampler for row in group if row.sampler],
                                        decoded)
        if firsts is None:
            return []
        return [(row, first) for row, first in zip(group, firsts)
                if row.grammar is None and row.failure is None]
