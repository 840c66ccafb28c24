"""EngineStats: a snapshot of what the engine is doing and has done; StatsBook keeps it.

Every write to the engine's figures goes through ``StatsBook``, under its lock: counters
the step core adds to as rows start, step and end, and gauges the engine sets each turn.
Callers on any thread read a consistent copy (``Engine.stats()``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace
from typing import Any

from engine.requests.outbound.results import FinishReason


@dataclass(frozen=True)
class SpeedUp:
    """One of the engine's speed-ups for the loaded model: on or off, and how or why.

    ``name``: ``fast_forward``, ``speculation``, ``prefix_reuse`` or ``prefix_disk``.
    ``detail`` says how it works on this model's caches when on (trimming, rolling back,
    reusing at stored boundaries), and why not when off (a setting, a cache kind).
    ``measured``: what the engine measured on this device since it loaded and decided by
    it (fast-forward: what a span and a step cost, spans taken and declined); the detail
    stays fixed (a /metrics label), this changes as the engine runs.
    """

    name: str
    on: bool
    detail: str
    measured: str = ""


@dataclass
class EngineStats:
    """Counters since the engine started; ``stats()`` returns a copy."""

    # Whether the chat model is loaded now: False before it first loads and again once
    # keep_alive has unloaded it. Loads (the first included) and unloads since the start,
    # and how long the last load took (weights read, warmed, lanes built).
    loaded: bool = False
    loads: int = 0
    unloads: int = 0
    last_load_seconds: float = 0.0
    batch_mode: str = "batch"  # "off" (max_batch 1), "serial" (caches cannot merge), "batch"
    context_limit: int | None = None
    # The weights as they run ("quantized 4-bit g32", "dequantized float32", "float32") and
    # the CPU kernels' part: "" off the CPU, "off: why", or the instruction set and what runs
    # on it (engine.device.loading.weight_policy).
    weight_format: str = ""
    cpu_kernels: str = ""
    # The loaded model's cache kinds (mlx-lm class names) and what each speed-up does on
    # them; set once when the model loads.
    cache_kinds: tuple[str, ...] = ()
    # KV as rows hold it: its bits (0: the model's own dtype; EngineConfig.kv_bits) and
    # the bytes one token's keys and values take over every layer.
    kv_bits: int = 0
    kv_bytes_per_token: int = 0
    speedups: tuple[SpeedUp, ...] = ()
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
    kv_bytes_held: int = 0  # KV bytes the batch lane's generator holds now (0 when idle)
    live_matchers: int = 0  # grammar matchers held by constrained rows
    prefix_hits: int = 0  # rows that started from a reused KV prefix
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens not prefilled thanks to reuse
    prefix_evictions: int = 0  # entries dropped by the byte cap, LRU or TTL
    prefix_bytes: int = 0  # KV bytes the prefix cache holds now
    prefix_entries: int = 0
    # Images (vision-language models): images the tower read, its seconds, features served
    # from the LRU (a second turn over the same image), the bytes that LRU holds.
    vision_images: int = 0
    vision_seconds: float = 0.0
    vision_feature_hits: int = 0
    vision_feature_bytes: int = 0
    vision_jobs: int = 0  # image rows waiting for or in their own prefill now
    # LoRA adapters (SamplingParams.adapter): loaded now, and their bytes (adapter_bytes caps).
    adapters_loaded: int = 0
    adapters_bytes: int = 0
    adapters_in_use: int = 0  # rows holding an adapter now (an adapter in use stays loaded)
    # The disk tier (prefix_cache_dir): entries read back, written, refused; what it holds.
    prefix_disk_hits: int = 0
    prefix_disk_hit_tokens: int = 0
    prefix_disk_written: int = 0
    prefix_disk_skipped: int = 0  # files refused (short, altered, another key) and removed
    prefix_disk_bytes: int = 0
    prefix_disk_entries: int = 0
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


_FIELDS = frozenset(f.name for f in fields(EngineStats))


class StatsBook:
    """The one writer of an engine's ``EngineStats``; safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = EngineStats()

    def snapshot(self) -> EngineStats:
        """A consistent copy of every figure."""
        with self._lock:
            return replace(self._stats)

    def set(self, **values: Any) -> None:
        """Set gauges (what is true now: rows running, bytes held...) in one update."""
        unknown = set(values) - _FIELDS
        if unknown:
            raise AttributeError(f"EngineStats has no field(s) {sorted(unknown)}")
        with self._lock:
            for name, value in values.items():
                setattr(self._stats, name, value)

    def add(self, **amounts: float) -> None:
        """Add to counters (tokens, seconds, requests) in one update."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._stats, name, getattr(self._stats, name) + amount)

    def stepped(self, seconds: float, width: int, tokens: int, forced: int,
                drafted: int) -> None:
        """A lane step: its time and width, and the tokens it produced."""
        with self._lock:
            stats = self._stats
            stats.steps += 1
            stats.step_seconds += seconds
            stats.peak_running = max(stats.peak_running, width)
            stats.generated_tokens += tokens
            stats.forced_tokens += forced
            stats.drafted_tokens += drafted

    def ended(self, reason: FinishReason, *, was_running: bool, was_pending: bool,
              **gauges: int) -> None:
        """A row ended: counted by outcome, no longer running or pending, and ``gauges``
        (what it held: the running rows' worst-case KV, live grammar matchers) without it.

        Called before its consumer wakes, one row at a time, so whoever holds a result
        sees its row gone and the counts agree with completed/cancelled at every moment.
        """
        with self._lock:
            stats = self._stats
            if reason is FinishReason.ERROR:
                stats.failed += 1
            elif reason is FinishReason.CANCELLED:
                stats.cancelled += 1
            else:
                stats.completed += 1
            if was_running:
                stats.running = max(0, stats.running - 1)
            elif was_pending:
                stats.pending = max(0, stats.pending - 1)
            for name, value in gauges.items():
                setattr(stats, name, value)
