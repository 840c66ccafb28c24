"""``/metrics``: request outcomes and latencies counted here, engine state read at scrape.

Each app has its own ``CollectorRegistry``, so several apps (tests, mounted twice) never
collide. Engine numbers (running and pending rows, batch width, tokens, prefix-cache hits,
KV bytes, whether the model is loaded) are read from ``Engine.stats()`` when Prometheus
scrapes, never copied, and so is which speed-ups are on for each model's cache kinds
(``mlx_engine_speedup``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import Engine, EngineStats, Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Family = GaugeMetricFamily | CounterMetricFamily
GAUGE = GaugeMetricFamily  # what is true now; may go down
COUNTER = CounterMetricFamily  # counted since the engine started; only goes up


class EngineFigure(NamedTuple):
    """One engine figure on /metrics, per served model: its name, help text, kind, and the
    ``EngineStats`` field its value is read from."""

    name: str
    help: str
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    field: str


# What /metrics reports of each engine, in the order it is rendered.
ENGINE_FIGURES: tuple[EngineFigure, ...] = (
    EngineFigure("mlx_engine_model_loaded",
                 "1 while the chat model is loaded; 0 before its first request and once "
                 "keep_alive has unloaded it.", GAUGE, "loaded"),
    EngineFigure("mlx_engine_model_last_load_seconds",
                 "Seconds the chat model's last load took.", GAUGE, "last_load_seconds"),
    EngineFigure("mlx_engine_running_rows", "Rows admitted (prefilling or decoding).",
                 GAUGE, "running"),
    EngineFigure("mlx_engine_pending_rows", "Requests waiting for admission.", GAUGE, "pending"),
    EngineFigure("mlx_engine_peak_batch_width", "Most rows decoded in one step.",
                 GAUGE, "peak_running"),
    EngineFigure("mlx_engine_kv_bytes", "Worst-case KV bytes of the running rows.",
                 GAUGE, "kv_bytes_projected"),
    EngineFigure("mlx_engine_prefix_cache_bytes", "KV bytes the prefix cache holds.",
                 GAUGE, "prefix_bytes"),
    EngineFigure("mlx_engine_prefix_disk_bytes",
                 "Bytes of prefix entries on disk (prefix_cache_dir).", GAUGE,
                 "prefix_disk_bytes"),
    # Memory against its bound (docs/memory.md): what is held, then what may be.
    EngineFigure("mlx_engine_mlx_active_bytes",
                 "Bytes in MLX's live arrays (weights, KV, prefix store).", GAUGE,
                 "mlx_active_bytes"),
    EngineFigure("mlx_engine_mlx_cache_bytes", "Freed bytes MLX's allocator keeps for reuse.",
                 GAUGE, "mlx_cache_bytes"),
    EngineFigure("mlx_engine_process_resident_bytes", "The process's resident set size.",
                 GAUGE, "resident_bytes"),
    EngineFigure("mlx_engine_weights_bytes", "Bytes of the model's weights.",
                 GAUGE, "weights_bytes"),
    EngineFigure("mlx_engine_kv_bits", "Bits each KV value is kept in (0: the model's own "
                 "dtype; kv_bits).", GAUGE, "kv_bits"),
    EngineFigure("mlx_engine_kv_bytes_per_token",
                 "Bytes one token's keys and values take over every layer.", GAUGE,
                 "kv_bytes_per_token"),
    EngineFigure("mlx_engine_kv_budget_bytes",
                 "Bound on running rows' KV plus the prefix cache (0 = none).", GAUGE,
                 "kv_budget_bytes"),
    EngineFigure("mlx_engine_prefix_cache_limit_bytes", "Bound on the prefix cache's bytes.",
                 GAUGE, "prefix_cache_limit_bytes"),
    EngineFigure("mlx_engine_mlx_cache_limit_bytes", "Bound on MLX's cache of freed buffers.",
                 GAUGE, "buffer_cache_limit_bytes"),
    EngineFigure("mlx_engine_resident_bound_bytes",
                 "What the settings let the process hold: weights + KV budget + buffer cache "
                 "limit + runtime.", GAUGE, "resident_bound_bytes"),
    EngineFigure("mlx_engine_embed_pending_requests",
                 "Embedding requests waiting on the engine thread.", GAUGE, "embed_pending"),
    EngineFigure("mlx_engine_adapters_loaded", "LoRA adapters loaded now.",
                 GAUGE, "adapters_loaded"),
    EngineFigure("mlx_engine_adapters_bytes",
                 "Bytes of the LoRA adapters loaded now (adapter_bytes caps).", GAUGE,
                 "adapters_bytes"),
    EngineFigure("mlx_engine_vision_feature_bytes",
                 "Bytes of image features the LRU keeps (vision_cache_bytes).", GAUGE,
                 "vision_feature_bytes"),
    EngineFigure("mlx_engine_kv_bytes_held",
                 "KV bytes the batch holds now, in every stage of a prompt.", GAUGE,
                 "kv_bytes_held"),
    EngineFigure("mlx_engine_adapters_in_use", "Rows holding a LoRA adapter now.",
                 GAUGE, "adapters_in_use"),
    EngineFigure("mlx_engine_vision_jobs", "Image rows waiting for or in their own prefill.",
                 GAUGE, "vision_jobs"),
    EngineFigure("mlx_engine_generated_tokens", "Tokens generated.",
                 COUNTER, "generated_tokens"),
    EngineFigure("mlx_engine_forced_tokens",
                 "Generated tokens a grammar forced (fast-forward, no step each).", COUNTER,
                 "forced_tokens"),
    EngineFigure("mlx_engine_drafted_tokens",
                 "Generated tokens from speculative drafts the model confirmed.", COUNTER,
                 "drafted_tokens"),
    EngineFigure("mlx_engine_prompt_tokens", "Prompt tokens admitted for prefill.",
                 COUNTER, "prompt_tokens"),
    EngineFigure("mlx_engine_prefix_cache_hit_tokens",
                 "Prompt tokens not prefilled thanks to the prefix cache.", COUNTER,
                 "prefix_hit_tokens"),
    EngineFigure("mlx_engine_prefix_disk_hit_tokens",
                 "Prompt tokens read back from disk, not prefilled.", COUNTER,
                 "prefix_disk_hit_tokens"),
    EngineFigure("mlx_engine_prefix_disk_written_entries", "Prefix entries written to disk.",
                 COUNTER, "prefix_disk_written"),
    EngineFigure("mlx_engine_prefix_disk_skipped_files",
                 "Prefix files refused (short, altered, another model).", COUNTER,
                 "prefix_disk_skipped"),
    EngineFigure("mlx_engine_steps", "Engine steps.", COUNTER, "steps"),
    EngineFigure("mlx_engine_model_loads",
                 "Chat model loads: the first, and each after keep_alive unloaded it.",
                 COUNTER, "loads"),
    EngineFigure("mlx_engine_model_unloads", "Chat model unloads by keep_alive.",
                 COUNTER, "unloads"),
    # The engine's own request outcomes (HTTP outcomes are mlx_server_requests).
    EngineFigure("mlx_engine_completed_requests", "Requests that finished.",
                 COUNTER, "completed"),
    EngineFigure("mlx_engine_cancelled_requests",
                 "Requests cancelled (disconnects, timeouts, callers).", COUNTER, "cancelled"),
    EngineFigure("mlx_engine_failed_requests", "Requests that failed.", COUNTER, "failed"),
    EngineFigure("mlx_engine_embed_requests", "Embedding requests that finished with vectors.",
                 COUNTER, "embed_requests"),
    EngineFigure("mlx_engine_embed_texts", "Texts embedded.", COUNTER, "embed_texts"),
    EngineFigure("mlx_engine_embed_tokens", "Tokens the encoder read.",
                 COUNTER, "embed_tokens"),
    EngineFigure("mlx_engine_embed_batches", "Encoder calls.", COUNTER, "embed_batches"),
    EngineFigure("mlx_engine_embed_cancelled_requests",
                 "Embedding requests cancelled or timed out.", COUNTER, "embed_cancelled"),
    EngineFigure("mlx_engine_embed_failed_requests", "Embedding requests that failed.",
                 COUNTER, "embed_failed"),
    EngineFigure("mlx_engine_vision_images",
                 "Images the vision tower read (features not in the LRU).", COUNTER,
                 "vision_images"),
    EngineFigure("mlx_engine_vision_seconds", "Seconds the vision tower and projector ran.",
                 COUNTER, "vision_seconds"),
    EngineFigure("mlx_engine_vision_feature_hits", "Images whose features came from the LRU.",
                 COUNTER, "vision_feature_hits"),
)


def _speedups(snapshots: Mapping[str, EngineStats]) -> GaugeMetricFamily:
    """``mlx_engine_speedup``: one sample per model and speed-up, its detail a label (the
    detail is fixed once the model loads, so the label set stays small)."""
    speedups = GaugeMetricFamily(
        "mlx_engine_speedup", "1 if the speed-up is on for the model's caches, else 0; "
        "detail says how it works on them, or why it is off.",
        labels=["model", "speedup", "cache_kinds", "detail"])
    for model, stats in snapshots.items():
        kinds = ",".join(stats.cache_kinds)
        for speedup in stats.speedups:
            speedups.add_metric([model, speedup.name, kinds, speedup.detail],
                                1.0 if speedup.on else 0.0)
    return speedups


class _EngineCollector(Collector):
    """Engine counters and gauges, labelled by served model, read at scrape time."""

    def __init__(self, engines: Callable[[], Mapping[str, Engine]]) -> None:
        """``engines``: the served models' engines, asked anew at every scrape."""
        self._engines = engines

    def collect(self) -> Iterator[Family]:
        """Every figure of ``ENGINE_FIGURES`` for each model, then the speed-ups."""
        # One snapshot per engine per scrape, so every figure of a model is from one moment.
        snapshots = {name: engine.stats() for name, engine in self._engines().items()}
        for figure in ENGINE_FIGURES:
            family = figure.kind(figure.name, figure.help, labels=["model"])
            for model, stats in snapshots.items():
                family.add_metric([model], float(getattr(stats, figure.field)))
            yield family
        yield _speedups(snapshots)


class ServerMetrics:
    """The app's metrics: one registry, request counters, latency histograms."""

    def __init__(self, engines: Callable[[], Mapping[str, Engine]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mlx_server_requests", "HTTP requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("mlx_server_time_to_first_token_seconds",
                              "Seconds from submit to the first token.", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.token_latency = Histogram("mlx_server_time_per_output_token_seconds",
                                       "Mean seconds per generated token after the first.",
                                       ["model"], buckets=_LATENCY_BUCKETS,
                                       registry=self.registry)
        self.registry.register(_EngineCollector(engines))

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def observe(self, model: str, usage: Usage | None) -> None:
        """Latencies of one finished request, as the engine measured them."""
        if usage is None:
            return
        if usage.time_to_first_token is not None:
            self.ttft.labels(model).observe(usage.time_to_first_token)
        if usage.decode_tokens_per_second:
            self.token_latency.labels(model).observe(1.0 / usage.decode_tokens_per_second)

    def render(self) -> bytes:
        return generate_latest(self.registry)
