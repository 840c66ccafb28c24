"""What Gemma 4's language model reads beside an image row's embeddings, as mlx-vlm gives it.

An image row of Gemma 4 is prefilled through the vision library's language model (the text
model's weights shared, ``VisionTower``), with what mlx-vlm's own generation passes it:

- its text tokens' embeddings scaled by ``embed_scale`` (``get_input_embeddings`` scales
  them; the tower's features are not);
- per-layer inputs (the small models' ``hidden_size_per_layer_input``) from the prompt's
  ids with every image, video and audio token read as token 0, as
  ``get_input_embeddings`` builds them;
- where the text config's ``use_bidirectional_attention`` is ``"vision"``, attention both
  ways among an image's tokens (a run of image or video tokens), causal elsewhere: the
  overlay mlx-vlm's language model puts on its masks when its processor's
  ``mm_token_type_ids`` are given. mlx-vlm applies it only to a square mask (a prompt
  prefilled whole, from an empty cache); here each attention layer's cache gives the
  overlaid mask at any offset (``ImageSpanMask``), so the row's chunks, which never cut an
  image (``VisionTower.whole_spans``), attend as the whole prompt does there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


class ImageSpanMask:
    """An attention layer's cache whose masks also let each image's tokens attend to each
    other both ways (``same``: the chunk's (N, N) pairs of one image); everything else is
    the layer itself."""

    def __init__(self, layer: Any, same: mx.array) -> None:
        self._layer = layer
        self._same = same

    def make_mask(self, n: int, window_size: int | None = None,
                  return_array: bool = False) -> Any:
        """The layer's causal mask (windowed where it is), as an array, with the chunk's
        image pairs let through."""
        base = self._layer.make_mask(n, window_size=window_size, return_array=True)
        keys = base.shape[-1]
        overlay = self._same if keys == n else mx.concatenate(
            [mx.zeros((n, keys - n), mx.bool_), self._same], axis=1)
        return base | overlay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class Gemma4Inputs:
    """Gemma 4's extra inputs for a chunk of an image row, read from the vision library's
    model (``vlm``) and its config."""

    def __init__(self, vlm: Any) -> None:
        config = vlm.config
        self._model = vlm.language_model.model
        self.text_scale: float = float(self._model.embed_scale)
        # The tokens mlx-vlm gives token 0's per-layer inputs, and those an image's
        # two-way attention spans (its image and video tokens).
        media = [getattr(config, name, None) for name in
                 ("image_token_id", "video_token_id", "audio_token_id")]
        self._media = np.array([t for t in media if t is not None])
        self._visual = np.array([t for t in media[:2] if t is not None])
        self.both_ways = (getattr(config.text_config, "use_bidirectional_attention", None)
                          == "vision")

    def per_layer_inputs(self, ids: list[int]) -> mx.array | None:
        """The chunk's per-layer inputs (None: the model has none)."""
        if not self._model.hidden_size_per_layer_input:
            return None
        tokens = np.where(np.isin(ids, self._media), 0, ids)
        result: mx.array = self._model.get_per_layer_inputs(mx.array(tokens[None]))
        return result

    def caches(self, cache: list[Any], ids: list[int]) -> list[Any]:
        """``cache`` as the chunk's attention reads it: each image's tokens both ways where
        the config says so and the chunk holds an image."""
        same = self._same_image(ids)
        if same is None:
            return cache
        return [ImageSpanMask(layer, same) if hasattr(layer, "make_mask") else layer
                for layer in cache]

    def _same_image(self, ids: list[int]) -> mx.array | None:
        """(N, N): the chunk's pairs of tokens of one run of image (or video) tokens, as
        mlx-vlm's ``_block_sequence_ids_for_mask`` groups them; None where none pairs."""
        if not self.both_ways or len(ids) < 2:
            return None
        visual = np.isin(ids, self._visual)
        if visual.sum() < 2:
            return None
        starts = visual & ~np.concatenate([[False], visual[:-1]])
        groups = np.where(visual, np.cumsum(starts) - 1, -1)
        same = (groups[:, None] == groups[None, :]) & (groups[:, None] != -1)
        return mx.array(same)
