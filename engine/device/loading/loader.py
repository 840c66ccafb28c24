"""Loading a model on the engine thread and building its lanes.

``load_model`` runs on the engine thread: it creates the thread's MLX stream, loads
weights and tokenizer, and probes the cache layout once (what the scheduler budgets
with). ``build_lanes`` makes the batch and serial lanes over the loaded model.

An engine whose model keep_alive unloaded loads it again with the tokenizer and stream it
kept, and builds its lanes over the prefix store and disk tier it kept (``PrefixTiers``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as load_weights

from engine.config import EngineConfig
from engine.core.footprint import LayerFootprint, ModelFootprint
from engine.core.lane import Lane, LaneKind
from engine.core.memory import MemoryBounds, resident_bytes, resolve_bounds
from engine.core.prefill_planner import PrefillPlanner
from engine.core.prefix_cache import PrefixStore
from engine.core.stats import SpeedUp
from engine.device.adapters.row_adapters import attach
from engine.device.lane.batch_lane import BatchLane
from engine.device.lane.serial_lane import SerialLane
from engine.device.loading.architecture import architecture_module, read_model_config
from engine.device.loading.cache_layout import footprint_of
from engine.device.loading.collectives import Channel, Group
from engine.device.loading.memory import (
    device_memory,
    limit_buffer_cache,
    on_accelerator,
    release_free_memory,
    usable_memory_bytes,
    weights_bytes,
)
from engine.device.loading.padding_probe import KNOWN_DIVERGENT, batch_divergence
from engine.device.loading.text_side import load_text_side, text_config_of, text_side_preferred
from engine.device.loading.weight_policy import WeightChoice, apply_weight_policy
from engine.device.prefix.prefix_disk import PrefixDisk, disk_key
from engine.device.prefix.prefix_reuse import OFF, PrefixReuse, reuse_policy
from engine.device.rows.batch_row import BatchRow
from engine.device.rows.sampling import SamplerCache
from engine.device.speedups.report import report
from engine.device.upstream.half_kv import install_half_kv
from engine.device.upstream.quantized_kv import install_quantized_kv
from engine.device.upstream.required import check_upstream
from engine.device.vision.prefill import VisionPrefill
from engine.device.vision.tower import VisionTower, checkpoint_tower_bytes
from engine.errors import InvalidModelError, UnsupportedModelError
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.inbound.vision_families import load_refused_because
from engine.requests.inbound.vision_formats import GRID_POSITIONS, VisionFormat

log = logging.getLogger("engine")


@dataclass
class LoadedModel:
    """Weights, tokenizer and what the engine learned about them at load time."""

    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    footprint: ModelFootprint
    stream: Any
    vocab_size: int
    bounds: MemoryBounds
    group: Group | None = None  # set when the model is sharded over a group of ranks
    path: Path | None = None  # the model's directory (the disk tier's key reads its files)
    # The CPU weight policy's choice (weight_policy.py).
    weights: WeightChoice = field(default_factory=lambda: WeightChoice("", ""))


@dataclass
class PrefixTiers:
    """The prefix store and its disk tier: what the lanes keep across an unload of the
    model (the store emptied, the disk's files and writer as they are)."""

    store: PrefixStore
    disk: PrefixDisk | None = None
    disk_off: str = ""  # why there is no disk tier, when one was asked for


@dataclass
class Lanes:
    """The two places rows run, and the prefix store the batch lane fills."""

    batch: BatchLane
    serial: SerialLane
    store: PrefixStore
    channel: Channel | None = None  # sharded: rank 0's messages to the other ranks
    disk_dir: str | None = None  # prefix_cache_dir as asked
    disk_off: str = ""  # why it is not used, when asked for
    # Rank 0 of a sharded engine: the lanes the loop drives (engine.distributed.replicate).
    replicated: dict[LaneKind, Lane] = field(default_factory=dict)

    def lane(self, kind: LaneKind) -> Lane:
        """The lane the engine loop drives: replicated to the followers when sharded."""
        found = self.replicated.get(kind)
        if found is not None:
            return found
        return self.batch if kind is LaneKind.BATCH else self.serial

    def speedups(self, *, serial: bool) -> tuple[SpeedUp, ...]:
        """What fast-forward, speculation and prefix reuse do on this model's caches, or
        why they are off (``serial``: every row runs on the serial lane)."""
        batch = self.batch
        fast_forward_asked, speculation_asked = batch.asked
        found = report(batch.cache_kinds, serial=serial, fast_forward=batch.fast_forward,
                       fast_forward_asked=fast_forward_asked, speculation=batch.speculation,
                       speculation_asked=speculation_asked, trims=batch.trims,
                       reuse_policy=batch.reuse.policy, reuse_bytes=self.store.max_bytes,
                       sharded=self.channel is not None, disk=self.disk_dir,
                       disk_off=None if batch.reuse.disk is not None else self.disk_off)
        if serial:
            return found
        measured = {"fast_forward": batch.costs.summary() if batch.forced_spans else "",
                    "speculation": batch.costs.check_summary() if batch.speculator else ""}
        return tuple(replace(s, measured=measured[s.name]) if measured.get(s.name) else s
                     for s in found)

    def speedups_version(self) -> int:
        """Moves when ``speedups()``' measured figures would (a report rebuilt only then)."""
        batch = self.batch
        if batch.forced_spans is None and batch.speculator is None:
            return -1
        return batch.costs.version

    def rows_held(self) -> dict[str, int]:
        """Rows each lane holds now (the local lanes; a probe's ``TurnReport``)."""
        return {LaneKind.BATCH.value: len(self.batch), LaneKind.SERIAL.value: len(self.serial)}

    def batch_kv_bytes(self) -> int:
        """KV bytes the batch lane's generator holds now, in every stage of a prompt."""
        return int(self.batch.generator.prompt_cache_nbytes)

    @staticmethod
    def device_memory() -> tuple[int, int]:
        """MLX's allocator now: bytes in live arrays, bytes it keeps cached for reuse."""
        return device_memory()

    def release_memory(self) -> None:
        """Nothing runs: hand stored prefixes to the disk writer, give freed buffers back
        to the OS."""
        self.batch.reuse.flush()
        release_free_memory()

    def close(self) -> None:
        """The engine is going away: finish writing stored prefixes to disk."""
        self.batch.reuse.close()

    def unload(self) -> PrefixTiers:
        """The model is being unloaded (nothing runs): hand stored prefixes to the disk
        writer, drop the memory store's entries (KV arrays of this model), and return the
        tiers the next load builds its lanes over."""
        self.batch.reuse.flush()
        self.store.clear()
        return PrefixTiers(self.store, self.batch.reuse.disk, self.disk_off)

    def adapter_figures(self) -> dict[str, int]:
        """The loaded LoRA adapters as ``EngineStats`` fields (none attached: none)."""
        adapters = self.batch.adapters
        if adapters is None:
            return {}
        return {"adapters_loaded": len(adapters.names()), "adapters_bytes": adapters.nbytes,
                "adapters_in_use": adapters.in_use}

    def vision_figures(self) -> dict[str, int | float]:
        """The vision tower's numbers as ``EngineStats`` fields (none for a text model)."""
        vision = self.batch.vision
        if vision is None:
            return {}
        tower = vision.built  # None until the first image row builds it
        if tower is None:
            return {"vision_images": 0, "vision_seconds": 0.0, "vision_feature_hits": 0,
                    "vision_feature_bytes": 0, "vision_jobs": len(vision)}
        counts = tower.counts
        return {"vision_images": counts.images, "vision_seconds": counts.vision_seconds,
                "vision_feature_hits": counts.feature_hits,
                "vision_feature_bytes": tower.cache.nbytes, "vision_jobs": len(vision)}

    def disk_figures(self) -> dict[str, int]:
        """The disk tier's numbers as ``EngineStats`` fields (zeros without one)."""
        disk = self.batch.reuse.disk
        if disk is None:
            return {}
        return {"prefix_disk_hits": disk.stats.hits,
                "prefix_disk_hit_tokens": disk.stats.hit_tokens,
                "prefix_disk_written": disk.stats.written,
                "prefix_disk_skipped": disk.stats.skipped,
                "prefix_disk_bytes": disk.nbytes, "prefix_disk_entries": len(disk)}


def load_model(path: Path, config: EngineConfig, group: Group | None = None,
               context_limit: int | None = None, *, tokenizer: Any = None,
               stream: Any = None) -> LoadedModel:
    """Load on this (the engine) thread; every later MLX call must come from it too.

    ``context_limit``: the context length the model declares (its config.json), if any.
    ``tokenizer`` and ``stream``: those of an earlier load of the same model (a reload
    after keep_alive unloaded it): only the weights are read again.

    With ``group`` (and ``config.shard``) each rank loads its shard; every rank must call
    this at the same time, since the warm-up forward pass runs the model's collectives.

    Raises ``FileNotFoundError`` (no such directory, no config.json, no weights),
    ``InvalidModelError`` (a corrupt config.json, weights that do not fit it) and
    ``UnsupportedModelError`` (a model type this mlx-lm has no architecture for), each
    naming the model directory.
    """
    check_upstream()  # an mlx-lm or mlx outside the pins: one error naming what is missing
    model_config = read_model_config(path)
    refused = load_refused_because(str(model_config["model_type"]))
    if refused is not None:  # a vision family the batch cannot serve, even for text
        raise UnsupportedModelError(f"{path} (model_type {model_config['model_type']!r}) "
                                    f"is not loaded: {refused}")
    text_side = text_config_of(model_config)  # a VLM whose family mlx-lm lacks: its text
    if text_side is None or (_has_module(model_config, path)
                             and not text_side_preferred(model_config)):
        text_side = None
        architecture_module(model_config, path)  # the load errors, named, up front
    if stream is None:
        stream = mx.new_thread_local_stream(mx.default_device())
    try:
        if group is not None and config.shard is not None:
            from mlx_lm.utils import sharded_load

            split = {"tensor_group" if config.shard == "tensor" else "pipeline_group": group}
            model, tokenizer = sharded_load(str(path), **split)[:2]
        elif text_side is not None:
            group = None
            model, loaded_tokenizer = load_text_side(Path(path), text_side)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        elif tokenizer is not None:
            group = None
            model = load_weights(Path(path))[0]
        else:
            group = None
            model, tokenizer = mlx_load(str(path))[:2]
    except ValueError as exc:  # weights that do not fit the config, a refused model_file
        raise InvalidModelError(f"mlx-lm could not build the model in {path}: {exc}") from exc
    weights = apply_weight_policy(model, config.quantized, config.cpu_int8)
    if config.kv_bits is not None:  # every row cache from here on keeps its KV quantized
        try:
            install_quantized_kv(model, config.kv_bits, config.kv_group_size)
        except ValueError as exc:
            raise InvalidModelError(f"{path}: {exc}") from exc
    if config.kv_dtype == "float16":  # keys and values projected, turned and kept in float16
        try:
            install_half_kv(model)
        except ValueError as exc:
            raise InvalidModelError(f"{path}: {exc}") from exc
    cache = make_prompt_cache(model, config.max_kv_size)
    with mx.stream(stream):
        logits = model(mx.array([[0]]), cache=cache)
        mx.eval(logits, [c.state for c in cache])
    if config.kv_dtype == "float16" and any(
            layer.keys.dtype != mx.float16 or layer.values.dtype != mx.float16
            for layer in cache if getattr(layer, "keys", None) is not None):
        raise InvalidModelError(f"{path}: kv_dtype='float16' does not reach this model's KV "
                                "cache (its attention widens keys or values after projecting "
                                "them); drop kv_dtype, or use kv_bits=8")
    layers = [fp for layer in cache for fp in footprint_of(layer)]
    # The logits' width is the vocabulary every mask and id check must match: configs put
    # vocab_size at the top, under text_config, or pad it, and wrappers hide their args.
    vocab = int(logits.shape[-1])
    footprint = ModelFootprint.of(layers, context_limit, _batch_divergence(model, stream, layers))
    bounds = memory_bounds(model, config)
    return LoadedModel(model, tokenizer, footprint, stream, vocab, bounds, group, Path(path),
                       weights)


def _has_module(config: dict[str, Any], path: Path) -> bool:
    """mlx-lm has a module for the checkpoint's own ``model_type``."""
    try:
        architecture_module(config, path)
    except UnsupportedModelError:
        return False
    return True


def _batch_divergence(model: Any, stream: Any, layers: list[LayerFootprint]) -> list[str]:
    """The model's kind and why, when mlx-lm's batched decode of it differs from its plain
    decode (its rows then run serially, exact); nothing to probe when already serial."""
    if not all(layer.batchable for layer in layers):
        return []
    kind = type(model).__module__.rsplit(".", 1)[-1]
    if kind in KNOWN_DIVERGENT:
        return [f"{kind}: {KNOWN_DIVERGENT[kind]}"]
    if all(layer.kind in ("KVCache", "RotatingKVCache") or _row_quantized(layer.kind)
           for layer in layers):
        # Attention masks its padding (every such kind checked by the sweep). kv_bits' rows
        # are the same attention over the same mask, their KV stored in 8 or 4 bits
        # (tests/engine/test_quantized_kv.py: batched equals alone); probing them anyway
        # ran mlx-lm's generator on a pipeline-sharded model, whose ranks then hung.
        return []
    why = batch_divergence(model, stream)
    return [] if why is None else [f"{kind}: {why}"]


def _row_quantized(kind: str) -> bool:
    """The kind of the engine's own quantized plain KV (``EngineConfig.kv_bits``)."""
    return kind.startswith("KVCache(") and kind.endswith("-bit)")


def memory_bounds(model: Any, config: EngineConfig) -> MemoryBounds:
    """The settings' bounds for this model on this machine; applies the buffer-cache cap."""
    bounds = resolve_bounds(config.kv_budget_bytes, config.prefix_cache_bytes,
                            config.buffer_cache_bytes, memory_bytes=usable_memory_bytes(),
                            weights_bytes=weights_bytes(model),
                            resident_at_load=resident_bytes(),
                            accelerator=on_accelerator())
    limit_buffer_cache(bounds.buffer_cache_bytes)
    return bounds


def build_lanes(loaded: LoadedModel, config: EngineConfig, compiler: GrammarCompiler,
                tiers: PrefixTiers | None = None,
                vision_format: VisionFormat | None = None) -> Lanes:
    """The lanes over a loaded model; sharded, with the channel rank 0 replicates them over.

    ``tiers``: the prefix store and disk tier an earlier load of this model kept (a
    reload); None makes them. Sharded, prefix reuse is off: the store's expiry and
    shrinking depend on each rank's clock and memory, and the ranks' lanes must make the
    same decisions. ``vision_format``: the checkpoint's image format (the preparer's), whose
    tower is built by the first image row (not here: a model that serves only text never
    imports mlx-vlm), and counted in the bounds from here; sharded engines read no images.
    """
    samplers = SamplerCache()
    if tiers is None:
        tiers = prefix_tiers(loaded, config)
    store, disk = tiers.store, tiers.disk
    policy = reuse_policy(loaded.footprint)
    reuse = PrefixReuse(store, policy, disk)
    # Which admitted rows prefill now, in which groups, sharing which stored heads: the
    # pure policy (engine.core), which the lane asks at every step.
    planner: PrefillPlanner[BatchRow] = PrefillPlanner.for_batch(
        config.max_batch, config.prefill_batch, config.prefill_chunk,
        head_min_tokens=store.min_tokens if reuse.enabled else None)
    if loaded.group is None:  # per-row LoRA adapters (SamplingParams.adapter)
        attach(loaded.model, config.adapter_bytes)
        loaded.bounds = replace(loaded.bounds, adapter_bytes=config.adapter_bytes)
    vision = None
    if vision_format is not None and loaded.group is None and loaded.path is not None:
        path, fmt = loaded.path, vision_format

        def tower() -> VisionTower:
            return VisionTower(path, loaded.model, fmt, loaded.stream,
                               config.vision_cache_bytes)

        # The tower's weights (sized from the checkpoint's headers: it is built later) and
        # its features' cap count in what the process may hold, from load on.
        loaded.bounds = replace(loaded.bounds, vision_bytes=checkpoint_tower_bytes(path)
                                + config.vision_cache_bytes)
        vision = VisionPrefill(loaded.model, loaded.stream, tower, config.prefill_chunk,
                               config.max_kv_size,
                               grid_positions=fmt.family in GRID_POSITIONS)
    batch = BatchLane(loaded.model, loaded.stream, compiler, samplers, reuse, planner,
                      max_batch=config.max_batch, max_kv_size=config.max_kv_size,
                      fast_forward=config.fast_forward, speculation=config.speculation,
                      vision=vision, vision_share=config.vision_step_share,
                      measured_costs=loaded.group is None)
    serial = SerialLane(loaded.model, loaded.stream, compiler, samplers, config.max_kv_size,
                        config.prefill_chunk, fast_forward=config.fast_forward, vision=vision)
    lanes = Lanes(batch, serial, store, disk_dir=config.prefix_cache_dir,
                  disk_off=tiers.disk_off)
    if loaded.group is None:
        return lanes
    channel = lanes.channel = Channel(loaded.group, loaded.stream)
    # The same random draws on every rank: rank 0's seed for the shared PRNG.
    mx.random.seed(channel.share_seed(int(time.time_ns()) & 0xFFFFFFFF))
    return lanes


def prefix_tiers(loaded: LoadedModel, config: EngineConfig) -> PrefixTiers:
    """The prefix store for a loaded model and, with ``prefix_cache_dir``, its disk tier."""
    sharded = loaded.group is not None
    store = PrefixStore(0 if sharded else loaded.bounds.prefix_cache_bytes,
                        config.prefix_cache_ttl,
                        min_tokens=config.prefix_min_tokens)
    policy = reuse_policy(loaded.footprint)
    disk = None
    disk_off = ("sharded engine" if sharded else "prefix_cache_bytes=0" if store.max_bytes <= 0
                else "prefix_cache_disk_bytes=0" if config.prefix_cache_disk_bytes <= 0
                else "no prefix reuse on this model's caches" if policy == OFF else "")
    if config.prefix_cache_dir is not None and not disk_off and loaded.path is not None:
        layout = make_prompt_cache(loaded.model, config.max_kv_size)
        try:
            disk = PrefixDisk(Path(config.prefix_cache_dir), disk_key(loaded.path, layout,
                                                                   kv=config.kv_dtype or ""),
                              config.prefix_cache_disk_bytes, config.prefix_min_tokens)
        except OSError as exc:  # a directory that cannot be made or read: memory only
            log.warning("prefix cache: %s cannot hold prefixes (%r); memory only",
                        config.prefix_cache_dir, exc)
            disk_off = f"cannot use the directory ({exc.strerror or exc})"
    return PrefixTiers(store, disk, disk_off)


def release_streams() -> None:
    """Called last on the engine thread: without it processes aborted at exit."""
    mx.clear_streams()
