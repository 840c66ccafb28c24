"""Whether mlx-lm's batched decode of a model matches its plain one-row decode.

The batch lane runs rows through mlx-lm's ``BatchGenerator``: batch caches, and the
shorter prompts of a prefill group left-padded. Attention layers mask that padding; some
layers of mlx-lm 0.32.2 do not: recurrent and linear-attention ones run their state
through it (mamba v1, jamba, bailing_moe_linear, olmo_hybrid, nemotron_h, longcat_flash_ngram's
n-gram embedding), kv-sharing ones read the batch cache differently (gemma3n, afm7), and a
few fail on a batch cache outright (gemma2, gpt_bigcode). A model that differs runs on
the serial lane, whose rows use plain caches.

Attention-only models (plain and rotating KV caches, most models) are known from the
architecture sweep (tests/engine/test_architectures.py): only ``KNOWN_DIVERGENT``
differ. Any other model is probed once at load time, a few forwards on ~30 tokens: a
short prompt decoded plainly, then alone in a batch, then beside a longer prompt.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

# Small ids exist in every vocabulary; the long prompt pads the short one by 20 tokens
# (a leak grows with the padding: nemotron_h's is 0.13 at 8 tokens, 4.2 at 18).
SHORT = [1, 2, 3, 4]
LONG = [(7 * i) % 9 + 1 for i in range(24)]
STEPS = 2
# Log-probability differences a leak makes start near 0.1; another batch size's matmul
# order changes float32 ones by ~1e-5 and bfloat16 ones by hundredths.
TOLERANCE = {mx.float32: 0.01}
TOLERANCE_LOW_PRECISION = 0.08
TOP = 16


def _plain(model: Any, prompt: list[int]) -> list[mx.array]:
    """Greedy decode with plain caches (what mlx-lm's stream_generate does): each step's
    log-probabilities."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    steps = []
    for _ in range(STEPS):
        logprobs = logits - mx.logsumexp(logits)
        steps.append(logprobs)
        token = mx.argmax(logprobs)
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
    return steps


def _batched(model: Any, stream: Any, prompts: list[list[int]]) -> list[mx.array]:
    """The first prompt's per-step log-probabilities, its prompts prefilled as one group."""
    generator = BatchGenerator(model, stream=stream, max_tokens=STEPS,
                               prefill_batch_size=len(prompts))
    try:
        first = generator.insert(prompts)[0]
        steps: list[mx.array] = []
        for _ in range(8 * STEPS):  # a group's first tokens may come a call late
            steps += [r.logprobs for r in generator.next_generated() if r.uid == first]
            if len(steps) >= STEPS:
                break
        return steps[:STEPS]
    finally:
        generator.close()


def _gap(reference: list[mx.array], other: list[mx.array]) -> float:
    """The largest difference over each step's most likely tokens."""
    if len(other) != len(reference):
        return float("inf")
    gaps = []
    for want, got in zip(reference, other):
        want, got = want.reshape(-1).astype(mx.float32), got.reshape(-1).astype(mx.float32)
        top = mx.argsort(-want)[:TOP]
        gaps.append(mx.max(mx.abs(want[top] - got[top])))
    gap: float = mx.max(mx.stack(gaps)).item()  # type: ignore[assignment]
    return gap


# mlx-lm 0.32.2 architectures whose batched decode differs, found by the sweep in
# tests/engine/test_architectures.py (which checks every other one decodes exactly); afm7's
# shows only after several decode steps, past what the load-time probe runs.
KNOWN_DIVERGENT = {
    "gemma2": "its attention mask does not broadcast over a batch cache",
    "gpt_bigcode": "its positions read a batch cache's per-row offsets as one number",
    "afm7": "its kv-reuse layers decode differently in a batch",
}


def batch_divergence(model: Any, stream: Any) -> str | None:
    """None when batched decoding matches plain decoding, else what differs."""
    with mx.stream(stream):
        reference = _plain(model, SHORT)
        try:
            alone = _batched(model, stream, [SHORT])
            padded = _batched(model, stream, [SHORT, LONG])
        except Exception as exc:  # a layer that cannot take a batch cache at all
            return f"its batched step fails in mlx-lm ({type(exc).__name__})"
        tolerance = TOLERANCE.get(reference[0].dtype, TOLERANCE_LOW_PRECISION)
        if _gap(reference, alone) > tolerance:
            return "it decodes differently in an mlx-lm batch"
        if _gap(reference, padded) > tolerance:
            return "its layers read a batch's left padding"
    return None
