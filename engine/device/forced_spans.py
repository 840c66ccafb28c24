"""Forced spans: tokens a row's grammar dictates, appended in one forward pass.

A constrained row often has no choice for many tokens in a row (a tool call's envelope,
JSON keys and separators, an enum's tail). mlx-lm's ``GenerationBatch`` feeds exactly
one token per row per step, so each of those would cost a whole batch step. Here the
rows with a forced span are fed their spans at once, right-padded into one batch on
mlx-lm's own ``BatchKVCache`` (the padding is rolled to the left afterwards, as mlx-lm
does for prompts), and the logits after each span's last token come back for sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


@dataclass
class SpanForward:
    """What one forward over several rows' spans produced."""

    logits: mx.array  # (rows, vocab): after each row's last span token
    caches: list[list[Any]]  # per row, per layer: its cache extended by its span


def spans_supported(model: Any, max_kv_size: int | None) -> bool:
    """Spans need plain KV caches (rotating, quantized and state caches are not handled)."""
    return all(type(layer) is KVCache for layer in make_prompt_cache(model, max_kv_size))


def forward_spans(model: Any, caches: Sequence[Sequence[Any]],
                  spans: Sequence[Sequence[int]]) -> SpanForward:
    """Feed each row its span on top of its own cache, all rows in one forward.

    Rows are merged into one ``BatchKVCache`` per layer (left-padded to the longest
    history, right-padded to the longest span), so a row's result does not depend on
    which other rows share the forward: padding is masked, never attended.
    """
    lengths = [len(span) for span in spans]
    width = max(lengths)
    padding = [width - n for n in lengths]
    layers = [BatchKVCache.merge([row[i] for row in caches]) for i in range(len(caches[0]))]
    if max(padding) > 0:
        for layer in layers:
            layer.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array([list(span) + [0] * pad for span, pad in zip(spans, padding)])
    logits = model(tokens, cache=layers)
    last = logits[mx.arange(len(spans)), mx.array(lengths) - 1]
    for layer in layers:
        layer.finalize()
    mx.eval(last, [layer.state for layer in layers])
    rows = [[layer.extract(i) for layer in layers] for i in range(len(spans))]
    return SpanForward(last, rows)
