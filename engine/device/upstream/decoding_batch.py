"""Rows rejoin mlx-lm's decoding batch with their next input, without a forward of their own.

A row that left the generator (a fast-forwarded span, speculation) comes back with its
cache and a token it has decided but not fed. ``BatchGenerator.insert_segments`` would
take that token as a one-token prompt: the generator then runs a forward for the
rejoining rows alone before merging them, one more forward in that step (~75 ms for a
lone row here, as much as a decode step). Instead the rows are appended to the decoding
batch with the token as their next input, so the batch's own next forward feeds it
alongside every other row. The generator hands the token back from that step; the lane
drops it (it was reported when it was decided).

mlx-lm does not expose its decoding batch: the fields set here are checked at load
(``required``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, StopSequences
from mlx_lm.models.cache import TokenBuffer


def join_decoding(generator: BatchGenerator, cache: list[Any],
                  histories: Sequence[list[int]], next_tokens: Sequence[int],
                  samplers: Sequence[Any], processors: Sequence[Sequence[Any]],
                  stops: StopSequences, max_tokens: int) -> list[int]:
    """Append rows to the generator's decoding batch; return their new uids.

    ``cache``: the rows' caches merged into one batch (a layer each); ``histories`` the
    tokens fed so far and ``next_tokens`` what the batch's next step feeds each row.
    Processors see the history as their context, as they would after a prompt.
    """
    rows = len(histories)
    start = generator._uid_count
    generator._uid_count += rows
    uids = list(range(start, start + rows))
    joining = GenerationBatch(generator.model, [], None, [], [], [], generator.sampler,
                              [], [], [])
    joining.uids = uids
    joining.prompt_cache = cache
    joining.tokens = [list(history) for history in histories]
    joining.samplers = list(samplers)
    joining.logits_processors = [tuple(p) for p in processors]
    joining.stop_sequences = [stops] * rows
    joining.max_tokens = [max_tokens] * rows
    joining._next_tokens = mx.array(list(next_tokens), dtype=mx.uint32)
    # What the step returns beside the echoed token; the lane discards both.
    joining._next_logprobs = [mx.zeros((1,)) for _ in range(rows)]
    joining._token_context = [TokenBuffer(history) for history in joining.tokens]
    joining._num_tokens = [0] * rows
    joining._matchers = [stops.matcher() for _ in range(rows)]
    generator._generation_batch.extend(joining)
    return uids


def next_inputs(generator: BatchGenerator,
                uids: Sequence[int]) -> dict[int, tuple[int, mx.array]]:
    """The token each decoding row's next step would feed, and the logprobs it was chosen
    from: the generator sampled it in the step that returned the row's last token (mlx-lm
    runs one step ahead)."""
    batch = generator._generation_batch
    index = {uid: i for i, uid in enumerate(batch.uids)}
    chosen: list[int] = batch._next_tokens.tolist()
    return {uid: (int(chosen[index[uid]]), batch._next_logprobs[index[uid]]) for uid in uids}


def decoding(generator: BatchGenerator, uid: int) -> bool:
    """Whether the row is in the decoding batch (not queued or prefilling a segment)."""
    return uid in generator._generation_batch.uids


def settle(generator: BatchGenerator, stream: Any) -> None:
    """Evaluate the decoding batch's cache now (rows were cut out and merged in)."""
    cache = generator._generation_batch.prompt_cache
    if cache:
        with mx.stream(stream):
            mx.eval([layer.state for layer in cache])
