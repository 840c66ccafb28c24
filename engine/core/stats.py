"""EngineStats: a snapshot of what the engine is doing and has done."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started; ``stats()`` returns a copy."""

    loaded: bool = False
    batch_mode: str = "batch"  # "off" (max_batch 1), "serial" (caches cannot merge), "batch"
    context_limit: int | None = None
    running: int = 0  # rows admitted to the batch or the serial lane
    pending: int = 0  # requests waiting for admission
    peak_running: int = 0  # most rows decoding in one step
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # in lane steps: device work and waiting on it
    overhead_seconds: float = 0.0  # the loop's own work around the steps (plan, update, publish)
    prompt_tokens: int = 0  # tokens of prompts admitted for prefill
    generated_tokens: int = 0
    forced_tokens: int = 0  # of those, dictated by a grammar and fed without a step each
    drafted_tokens: int = 0  # of those, prompt-lookup drafts the model confirmed (speculation)
    kv_bytes_projected: int = 0  # worst-case KV bytes of the running rows
    live_matchers: int = 0  # grammar matchers held by constrained rows
    prefix_hits: int = 0  # rows that started from a reused KV prefix
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens not prefilled thanks to reuse
    prefix_evictions: int = 0  # entries dropped by the byte cap, LRU or TTL
    prefix_bytes: int = 0  # KV bytes the prefix cache holds now
    prefix_entries: int = 0
    # MLX's allocator, read on the engine thread each turn: live arrays (weights, KV, the
    # prefix store) and freed buffers it keeps for reuse (mx.clear_cache releases them).
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0
    # The process's resident set, read each turn, and the bounds the settings give it
    # (engine.core.memory): resident ~= weights + KV budget + buffer cache limit + runtime.
    resident_bytes: int = 0
    weights_bytes: int = 0
    kv_budget_bytes: int = 0  # running rows' worst-case KV plus the prefix store (0 = no cap)
    prefix_cache_limit_bytes: int = 0
    buffer_cache_limit_bytes: int = 0  # mx.set_cache_limit
    resident_bound_bytes: int = 0  # the formula's sum (with no KV cap: without KV)
    # Embeddings, run on the engine thread between decode steps (engine.embed).
    embed_requests: int = 0  # finished with vectors
    embed_texts: int = 0
    embed_tokens: int = 0  # after truncation, [CLS] and [SEP] included
    embed_batches: int = 0  # encoder calls
    embed_peak_batch_texts: int = 0  # most texts in one encoder call
    embed_pending: int = 0  # requests waiting for their batch
    embed_cancelled: int = 0  # cancelled or timed out: never run, or their vectors dropped
    embed_failed: int = 0
    embed_seconds: float = 0.0  # in encoder calls
