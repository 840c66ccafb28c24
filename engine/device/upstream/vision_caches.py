"""mlx-lm's cache layers as the vision library's language model reads them.

An M-RoPE family's image rows are prefilled by mlx-vlm's language model (it places image
tokens on their grid of positions) into the row's mlx-lm cache, which then joins the
batch. Attention layers' caches are read the same by both; a hybrid's recurrent layers
(Qwen3.5's gated delta-net) are written through mlx-vlm's own ``ArraysCache`` methods,
so each is given a view of the mlx-lm layer that shares its state list: what mlx-vlm
writes there is the mlx-lm layer's state.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache


def vision_library_caches(cache: list[Any]) -> list[Any]:
    """``cache`` with each recurrent layer replaced by an mlx-vlm view of its state."""
    from mlx_vlm.models.cache import ArraysCache as LibraryArrays  # the vision extra

    views: list[Any] = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            view = LibraryArrays(len(layer.cache))
            view.cache = layer.cache  # the same list: its writes are the layer's state
            views.append(view)
        else:
            views.append(layer)
    return views
