"""A vision-language model's image side: its tower and projector, and their features per image.

The text side is mlx-lm's model of the checkpoint (every lane, cache and kernel works on
it as on any text model); ``VisionTower`` holds the rest, built by mlx-vlm (the ``vision``
extra) from the same directory when the first image row needs it (``VisionPrefill``), not
at load: a vision checkpoint that only ever serves text never imports the vision stack.
Its language-model weights are never read: its token embedding is the text model's own
module. ``checkpoint_tower_bytes`` sizes the tower from the checkpoint's files alone, so
the memory bounds count it from load.

``start`` builds the tower and projector's forward for one image on the engine thread,
evaluated a block at a time (``FeatureRun``); it gives what the family puts at that image's
tokens: the embeddings mlx-vlm's own ``get_input_embeddings`` computes there, read from a
prompt of just the image's block. So
whatever a family scales or normalises, the row gets the vision library's own values.
Features are kept in an LRU bounded in bytes (``FeatureCache``), keyed by the image's hash
and preprocessing: a conversation's second turn over a screenshot skips the tower.
"""

from __future__ import annotations

import json
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.device.adapters.row_adapters import adapters_of
from engine.device.upstream.half_kv import has_half_kv, install_half_kv
from engine.device.upstream.quantized_kv import RowQuantizedKVCache
from engine.device.upstream.required import check_vision
from engine.device.upstream.vision_blocks import install_recorder, recording
from engine.device.upstream.vision_caches import vision_library_caches
from engine.device.vision.gemma4_audio import audio_tower_inputs
from engine.device.vision.gemma4_inputs import Gemma4Inputs
from engine.requests.inbound.prompts import PromptImage
from engine.requests.inbound.vision_formats import (
    GRID_POSITIONS,
    LIBRARY_PREFILL,
    VisionFormat,
)


@dataclass
class VisionCounts:
    """What the tower did: images it read, seconds it took, features served from the LRU."""

    images: int = 0
    vision_seconds: float = 0.0
    feature_hits: int = 0


class FeatureCache:
    """Features by image key, least recently used first out, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str) -> mx.array | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: str, features: mx.array) -> None:
        if features.nbytes > self.max_bytes or key in self._entries:
            return
        self._entries[key] = features
        self.nbytes += features.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _text_embedding(model: Any) -> Any:
    """The text model's token embedding module (mlx-lm's wrappers nest it differently)."""
    for path in (("language_model", "model", "embed_tokens"), ("model", "embed_tokens"),
                 ("language_model", "embed_tokens")):
        found = model
        for name in path:
            found = getattr(found, name, None)
            if found is None:
                break
        if found is not None:
            return found
    raise ValueError(f"{type(model).__name__}: no token embedding found")


class FeatureRun:
    """An image's tower forward, built lazily and evaluated one block (a transformer layer
    of the tower) per ``step``, so a large tower is spread over engine steps. The graph is
    the one forward, so the features are the same as evaluated at once."""

    def __init__(self, stages: list[mx.array], features: mx.array, tower: VisionTower,
                 key: str | None) -> None:
        self._stages = stages
        self._features = features
        self._tower = tower
        self._key = key  # None: served from the LRU, nothing to evaluate

    def step(self) -> mx.array | None:
        """Evaluate the next block; the features once the last is done."""
        if self._key is None:
            return self._features
        started = time.perf_counter()
        with mx.stream(self._tower.stream):
            if self._stages:
                mx.eval(self._stages.pop(0))
                self._tower.counts.vision_seconds += time.perf_counter() - started
                return None
            mx.eval(self._features)
        self._tower._finished(self._key, self._features, time.perf_counter() - started)
        self._key = None
        return self._features


class VisionTower:
    """The tower, projector and embedding that turn an image into its tokens' embeddings."""

    def __init__(self, path: Path, text_model: Any, fmt: VisionFormat, stream: Any,
                 cache_bytes: int) -> None:
        check_vision()  # the vision extra's names, before any is used
        from mlx_vlm.utils import load_model  # the ``vision`` extra: only for such models

        vlm = load_model(Path(path), lazy=True)
        embed = _text_embedding(text_model)
        language = vlm.language_model
        inner = getattr(language, "model", language)
        self.grid_positions = fmt.family in GRID_POSITIONS
        self.library_prefill = fmt.family in LIBRARY_PREFILL
        # Gemma 4: scaled text embeddings, per-layer inputs, images attended both ways.
        self.gemma4 = Gemma4Inputs(vlm) if fmt.family == "gemma4" else None
        # An image's tokens are prefilled in one chunk (they attend to each other).
        self.whole_spans = self.gemma4 is not None and self.gemma4.both_ways
        if self.library_prefill:
            # An image row's prefill runs through the vision library's language model
            # (which places image tokens on their grid of positions, or reads what else
            # the family's image rows need): the text model's own weights, shared (its
            # layers read nothing from disk).
            adapters = adapters_of(text_model)
            if adapters is not None:  # an adapter row's image prefill adds its adapter here
                adapters.mirror(language, _text_language(text_model))
            _share_weights(language, _text_language(text_model))
            if has_half_kv(text_model):  # kv_dtype="float16": image rows' KV as text rows'
                install_half_kv(language)
        else:  # only its embedding is used: the text model's own
            inner.layers = []
        if self.grid_positions:
            self._rope = next(layer.self_attn.rope for layer in text_model.layers
                              if hasattr(layer, "self_attn"))  # a hybrid's first attention
        inner.embed_tokens = embed
        self._text_model = text_model
        self._vlm = vlm
        self.image_token = fmt.image_token
        # The tokens features go at: images', and videos' where the family reads them.
        video_token = getattr(fmt, "video_token", None)
        self.media_tokens = np.array([fmt.image_token,
                                      *(() if video_token is None else (video_token,))])
        # Qwen3-VL's deepstack: the tower's features from some of its blocks, each added to
        # one of the text model's first layers at the image's tokens.
        self.deepstack_layers = len(getattr(getattr(vlm.config, "vision_config", None),
                                            "deepstack_visual_indexes", None) or ())
        towers_root = getattr(vlm, "vision_tower", getattr(vlm, "vision_model", None))
        self.blocks_recorded = towers_root is not None and install_recorder(towers_root)
        if getattr(vlm, "audio_tower", None) is not None:  # Gemma 4's conformer, a block a unit
            install_recorder(vlm.audio_tower)
        self.embed = embed
        self.stream = stream
        towers = [module for name, child in vlm.children().items() if name != "language_model"
                  for module in (child if isinstance(child, list) else [child])]  # InternVL's mlp1
        with mx.stream(stream):
            mx.eval([m.parameters() for m in towers])
        self.weight_bytes = sum(int(v.nbytes) for m in towers
                                for _, v in _flat(m.parameters()))
        self.cache = FeatureCache(cache_bytes)
        self.counts = VisionCounts()

    def start(self, image: PromptImage) -> FeatureRun:
        """The tower's forward for ``image``, to evaluate a block at a time
        (``FeatureRun.step``, which ends with the (span length, hidden) embeddings of the
        image's span: the tower's features at its image tokens, the family's own embeddings
        between them); an image in the LRU is done at once."""
        found = self.cache.get(image.key)
        if found is not None:
            self.counts.feature_hits += 1
            return FeatureRun([], found, self, None)
        started = time.perf_counter()
        outputs: list[mx.array] = []
        with mx.stream(self.stream), recording(outputs):
            block = mx.array([list(image.block)])
            pixels: mx.array | None
            extra: dict[str, Any]
            if getattr(image, "audio", False):  # a clip: the audio tower's frames, no pixels
                pixels, extra = None, dict(audio_tower_inputs(
                    image.read_pixels(), image.extra["feature_extractor"]))
            else:
                pixels = mx.array(image.read_pixels())
                extra = {k: mx.array(v) if k in _ARRAY_INPUTS else v
                         for k, v in image.extra.items()}
            if getattr(image, "video", False):  # a video's frames: the tower's video input
                extra["pixel_values_videos"] = pixels
                pixels = None
            out = self._vlm.get_input_embeddings(
                block, pixels, mask=mx.ones(block.shape, mx.int32), **extra)
            embeds = getattr(out, "inputs_embeds", out)
            features: mx.array = embeds[0, image.first:image.first + image.length]
            deep = getattr(out, "deepstack_visual_embeds", None)
            if self.deepstack_layers and deep is not None:
                # After the span's embeddings: each deepstack layer's rows at its image tokens.
                stacked = mx.stack(list(deep)) if isinstance(deep, list | tuple) else deep
                features = mx.concatenate(
                    [features, stacked.reshape(-1, features.shape[-1])], axis=0)
        self.counts.vision_seconds += time.perf_counter() - started
        return FeatureRun(outputs, features, self, image.key)

    def _finished(self, key: str, features: mx.array, seconds: float) -> None:
        self.counts.images += 1
        self.counts.vision_seconds += seconds
        self.cache.put(key, features)

    def embeddings(self, prompt: list[int], start: int, end: int,
                   images: tuple[PromptImage, ...], features: dict[str, mx.array]) -> mx.array:
        """Embeddings of ``prompt[start:end]``: the tokens' own, the features at image spans."""
        pieces = []
        at = start
        for image in sorted(images, key=lambda i: i.start):
            lo, hi = max(image.start, start), min(image.start + image.length, end)
            if lo >= hi:
                continue
            if at < lo:
                pieces.append(self._text(prompt[at:lo]))
            pieces.append(features[image.key][lo - image.start:hi - image.start])
            at = hi
        if at < end:
            pieces.append(self._text(prompt[at:end]))
        return mx.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    def _text(self, ids: list[int]) -> mx.array:
        """Text tokens' embeddings as the family's ``get_input_embeddings`` gives them."""
        embedded: mx.array = self.embed(mx.array(ids))
        return embedded if self.gemma4 is None else embedded * self.gemma4.text_scale

    def chunk_end(self, images: tuple[PromptImage, ...], end: int) -> int:
        """A prefill chunk's end, moved to the end of an image it would cut where an
        image's tokens attend to each other both ways (``whole_spans``; an audio clip's
        attend causally, so a chunk may cut it)."""
        if self.whole_spans:
            for image in images:
                if (image.start < end < image.start + image.length
                        and not getattr(image, "audio", False)):
                    return image.start + image.length
        return end

    def deepstack(self, prompt: list[int], start: int, end: int,
                  images: tuple[PromptImage, ...], features: dict[str, mx.array],
                  ) -> tuple[mx.array, list[mx.array]] | None:
        """Qwen3-VL's deepstack inputs for ``prompt[start:end]``: the mask of its image
        tokens, and each deepstack layer's rows there (None: no deepstack, or no image
        token in the chunk)."""
        if not self.deepstack_layers:
            return None
        ids = np.array(prompt[start:end])
        mask = np.isin(ids, self.media_tokens)
        if not mask.any():
            return None
        layers: list[list[mx.array]] = [[] for _ in range(self.deepstack_layers)]
        for image in sorted(images, key=lambda i: i.start):
            span = np.array(prompt[image.start:image.start + image.length])
            at = np.flatnonzero(np.isin(span, self.media_tokens))
            inside = at[(image.start + at >= start) & (image.start + at < end)]
            if not len(inside):
                continue
            found = features[image.key]
            rows = mx.array(np.searchsorted(at, inside))
            for layer in range(self.deepstack_layers):
                block = found[image.length + layer * len(at):
                              image.length + (layer + 1) * len(at)]
                layers[layer].append(block[rows])
        return mx.array(mask[None]), [mx.concatenate(pieces, axis=0) for pieces in layers]

    def prefill(self, cache: list[Any], ids: list[int], embeds: mx.array,
                positions: np.ndarray | None,
                deepstack: tuple[mx.array, list[mx.array]] | None = None) -> None:
        """Run ``ids`` (their ``embeds``) into ``cache``; ``positions`` (3, n) places them on
        the grid (M-RoPE families), else they follow the cache's offset; ``deepstack``
        (``deepstack``) is added at the chunk's image tokens. Evaluated."""
        inputs = mx.array([ids])
        if not self.library_prefill:
            self._text_model(inputs, cache=cache, input_embeddings=embeds[None])
        else:
            extra: dict[str, Any] = {}
            if deepstack is not None:
                extra = {"visual_pos_masks": deepstack[0],
                         "deepstack_visual_embeds": deepstack[1]}
            if positions is not None:
                extra["position_ids"] = mx.array(positions[:, None, :])
            layers = vision_library_caches(cache)
            if self.gemma4 is not None:
                per_layer = self.gemma4.per_layer_inputs(ids)
                if per_layer is not None:
                    extra["per_layer_inputs"] = per_layer
                layers = self.gemma4.caches(layers, ids)
            self._vlm.language_model(inputs, inputs_embeds=embeds[None], cache=layers,
                                     **extra)
        mx.eval([layer.state for layer in cache])

    def shift_positions(self, cache: list[Any], shift: int) -> None:
        """Rotate every cached key by ``-shift`` positions: the cache then holds the prompt as
        if each token sat ``shift`` positions earlier, so the text after the images decodes
        at the cache's own offsets (RoPE rotations compose)."""
        if not shift:
            return
        def turned(keys: mx.array) -> mx.array:
            b, h, n, d = keys.shape
            rotated: mx.array = self._rope(keys.reshape(b, h, n, 1, d), offset=-shift)
            return rotated.reshape(b, h, n, d)

        for layer in cache:
            if getattr(layer, "keys", None) is None:  # a hybrid's recurrent state: no positions
                continue
            if isinstance(layer, RowQuantizedKVCache):  # kv_bits: turned, quantized again
                layer.map_keys(turned, layer.offset)
                continue
            held = layer.offset
            keys = layer.keys[..., :held, :]
            b, h, n, d = keys.shape
            turned = self._rope(keys.reshape(b, h, n, 1, d), offset=-shift).reshape(b, h, n, d)
            layer.keys[..., :held, :] = turned
        mx.eval([layer.state for layer in cache])


# Checkpoint tensors under these names are the tower and projector (what mlx-lm's text
# models drop from a vision checkpoint: Gemma 3, Mistral 3, Qwen2-VL/2.5-VL, LFM2-VL;
# SmolVLM / Idefics3's vision_model and connector, InternVL's mlp1, Gemma 4's embed_vision
# and its audio tower's).
TOWER_NAMES = frozenset({"vision_tower", "visual", "multi_modal_projector", "vision_model",
                         "connector", "mlp1", "embed_vision", "audio_tower", "embed_audio"})


def checkpoint_tower_bytes(path: Path) -> int:
    """Bytes of the checkpoint's tower and projector tensors, read from its safetensors
    headers (no weights read, no mlx-vlm): what the tower holds once built, as stored."""
    total = 0
    for file in sorted(Path(path).glob("model*.safetensors")):
        with open(file, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__" and TOWER_NAMES.intersection(name.split(".")):
                start, end = entry["data_offsets"]
                total += int(end) - int(start)
    return total


# The tower inputs mlx-vlm reads as arrays (the others as Python values).
_ARRAY_INPUTS = frozenset({"image_grid_thw", "video_grid_thw", "pixel_attention_mask",
                           "spatial_shapes"})


def _share_weights(target: Any, source: Any) -> None:
    """Give ``target`` ``source``'s arrays under the names both have; every weight of
    ``target`` must be found (none left as initialised)."""
    from mlx.utils import tree_unflatten

    theirs = dict(_flat(source.parameters()))
    ours = dict(_flat(target.parameters()))
    missing = sorted(k for k in ours if k not in theirs)
    if missing:
        raise ValueError(f"the text model has no weights for the vision library's "
                         f"{missing[:3]}")
    target.update(tree_unflatten([(k, theirs[k]) for k in ours]))


def _text_language(model: Any) -> Any:
    """The text model's language model (mlx-lm's VLM wrappers nest it)."""
    return getattr(model, "language_model", model)


def _flat(tree: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    flat: list[tuple[str, mx.array]] = tree_flatten(tree)  # type: ignore[assignment]
    return flat
