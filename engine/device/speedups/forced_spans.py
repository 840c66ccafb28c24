"""Forced spans: tokens a row's grammar dictates, appended in one forward pass.

A constrained row often has no choice for many tokens in a row (a tool call's envelope,
JSON keys and separators, an enum's tail). mlx-lm's ``GenerationBatch`` feeds exactly
one token per row per step, so each of those would cost a whole batch step. Here the
rows with a forced span are fed their spans at once, right-padded into one batch on
mlx-lm's own batch caches, exactly as mlx-lm prefills a right-padded prompt chunk, and
the logits after each span's last token come back for sampling.

Forced tokens are certain, so nothing fed here is ever taken back: every cache kind
advances through a span as through a prompt chunk. A sliding window (``BatchRotatingKVCache``)
masks each position to its window and rolls the padding out of the ring; a state cache
(``ArraysCache``: SSM, linear attention, convolutions) is told each row's length, so its
state stops at the row's last real token, not at the padding.

Only those last positions go through the output head where the architecture allows it
(``last_logits``): the head is a fifth of a small model's work per token, and a span
forward would otherwise compute it for every forced token only to discard it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.device.rows.row_cache import merged, rows_after_chunk, supported
from engine.device.upstream.fast_ops import marked_forward


@dataclass
class SpanForward:
    """What one forward over several rows' spans produced."""

    logits: mx.array  # (rows, vocab): after each row's last span token
    caches: list[list[Any]]  # per row, per layer: its cache extended by its span


# Architectures whose ``Model.__call__`` is exactly backbone -> (tied or own) output head.
_BACKBONE_THEN_HEAD = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2",
                                 "mlx_lm.models.qwen3", "mlx_lm.models.phi3"})


def last_logits(model: Any, tokens: mx.array, cache: list[Any],
                positions: mx.array) -> mx.array:
    """Logits at one position per row (``positions``), computing the head only there."""
    rows = mx.arange(tokens.shape[0])
    logits: mx.array
    if type(model).__module__ not in _BACKBONE_THEN_HEAD:
        logits = model(tokens, cache=cache)[rows, positions]
    else:
        with marked_forward(model):  # the backbone alone still takes the CPU kernels
            hidden = model.model(tokens, cache)[rows, positions]
        head = (model.model.embed_tokens.as_linear if model.args.tie_word_embeddings
                else model.lm_head)
        logits = head(hidden)
    return logits


def spans_supported(model: Any, max_kv_size: int | None) -> bool:
    """Spans need caches that merge into a batch and take a right-padded chunk: plain KV,
    sliding windows, state caches and lists of them (quantized KV does not merge)."""
    return supported(make_prompt_cache(model, max_kv_size))


def forward_spans(model: Any, caches: Sequence[Sequence[Any]],
                  spans: Sequence[Sequence[int]]) -> SpanForward:
    """Feed each row its span on top of its own cache, all rows in one forward.

    Rows are merged into one batch cache per layer (left-padded to the longest history,
    right-padded to the longest span), so a row's result does not depend on which other
    rows share the forward: padding is masked, never attended, and never enters a state.
    """
    lengths = [len(span) for span in spans]
    width = max(lengths)
    padding = [width - n for n in lengths]
    layers = merged(caches)
    if max(padding) > 0:
        for layer in layers:
            layer.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array([list(span) + [0] * pad for span, pad in zip(spans, padding)])
    last = last_logits(model, tokens, layers, mx.array(lengths) - 1)
    rows = rows_after_chunk(layers, padding)
    mx.eval(last, [[layer.state for layer in row] for row in rows])
    return SpanForward(last, rows)
