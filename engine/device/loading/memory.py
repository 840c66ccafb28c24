"""MLX's side of the memory bounds: weights' bytes, the device's memory, the buffer cache.

The formula and its ``auto`` defaults are pure (``engine.core.memory``); this module reads the
numbers only MLX knows, applies the buffer-cache limit, and gives freed memory back.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine._platform.heap import trim_heap
from engine.core.memory import physical_memory_bytes

# mx.device_info() keys naming the memory a model can use, best first: Metal's working set
# (what the GPU may keep resident), a CUDA device's memory; on CPU neither exists.
_DEVICE_MEMORY_KEYS = ("max_recommended_working_set_size", "memory_size", "total_memory")


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters as loaded (shared arrays counted once)."""
    seen: set[int] = set()
    total = 0
    leaves = tree_flatten(model.parameters())
    assert isinstance(leaves, list)  # a dict only when asked for one (destination=)
    for _, array in leaves:
        if id(array) not in seen:
            seen.add(id(array))
            total += int(array.nbytes)
    return total


def on_accelerator() -> bool:
    """Whether arrays live on a GPU (Metal, CUDA) rather than in malloc'd CPU memory."""
    return bool(mx.default_device() == mx.gpu)


def usable_memory_bytes() -> int:
    """Memory the model and its KV live in: the accelerator's, else RAM (cgroup-limited)."""
    info = mx.device_info()
    for key in _DEVICE_MEMORY_KEYS:
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return physical_memory_bytes()


def limit_buffer_cache(limit: int) -> None:
    """Cap the freed buffers MLX keeps for reuse (process-wide: the last engine wins)."""
    mx.set_cache_limit(limit)


def device_memory() -> tuple[int, int]:
    """MLX's allocator now: bytes in live arrays, bytes it keeps cached for reuse."""
    return int(mx.get_active_memory()), int(mx.get_cache_memory())


def release_free_memory() -> None:
    """After a peak: drop MLX's cached buffers and return free heap pages to the OS.

    Only when idle: the next burst reallocates what this gives back.
    """
    mx.clear_cache()
    trim_heap()
