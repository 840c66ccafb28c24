"""Rows rejoin mlx-lm's decoding batch with their next input, without a forward of their own.

A row that left the generator (a fast-forwarded span, speculation) comes back with its
cache and a token it has decided but not fed. ``BatchGenerator.insert_segments`` would
take that token as a one-token prompt: the generator then runs a forward for the
rejoining rows alone before merging them, one more forward in that step (~75 ms for a
lone row here, as much as a decode step). Instead the rows are appended to the decoding
batch with the token as their next input, so the batch's own next forward feeds it
alongside every other row. The generator hands the token back from that step; the lane
drops it (it was reported when it was decided).

This reaches into the generator's decoding batch, which mlx-lm does not expose:
``direct_join_supported`` checks the fields it needs once, and the lane falls back to
``insert_segments`` when they are missing (mlx-lm is pinned below 0.33).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, StopSequences
from mlx_lm.models.cache import TokenBuffer

from engine.device.row_cache import merged

_BATCH_FIELDS = ("_next_tokens", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers", "_current_tokens", "_current_logprobs")


def direct_join_supported(generator: BatchGenerator) -> bool:
    """Whether this mlx-lm's generator has the decoding-batch fields a direct join sets."""
    batch = getattr(generator, "_generation_batch", None)
    return (isinstance(batch, GenerationBatch) and isinstance(
        getattr(generator, "_uid_count", None), int)
        and all(hasattr(batch, name) for name in _BATCH_FIELDS)
        and callable(getattr(batch, "extend", None)))


def join_decoding(generator: BatchGenerator, caches: Sequence[Sequence[Any]],
                  histories: Sequence[list[int]], next_tokens: Sequence[int],
                  samplers: Sequence[Any], processors: Sequence[Sequence[Any]],
                  stops: StopSequences, max_tokens: int) -> list[int]:
    """Append rows to the generator's decoding batch; return their new uids.

    Each row's ``caches`` hold ``histories`` (the tokens fed so far) and ``next_tokens``
    is what the batch's next step feeds it. Processors see the history as their context,
    as they would after a prompt.
    """
    rows = len(caches)
    start = generator._uid_count
    generator._uid_count += rows
    uids = list(range(start, start + rows))
    joining = GenerationBatch(generator.model, [], None, [], [], [], generator.sampler,
                              [], [], [])
    joining.uids = uids
    joining.prompt_cache = merged(caches)  # each layer's own batch kind
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
