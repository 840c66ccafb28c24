"""What one engine's settings let the process hold: the bounds and the formula (no mlx).

    resident ~= weights + KV budget + MLX buffer cache limit + runtime

* weights: the model's parameters as loaded (float32 on CPU: 4 bytes a parameter).
* KV budget: the worst-case KV of the running rows PLUS the prefix store; the scheduler
  admits a row only when both fit and shrinks the store first (it gives way to rows).
* MLX buffer cache: freed buffers MLX keeps for reuse, capped by ``mx.set_cache_limit``.
* runtime: the interpreter, libraries, tokenizer and step transients, measured at load
  (the resident bytes then, less the weights) plus a step allowance.

Defaults scale to the machine: ``auto`` values are fractions of the memory left beside
the weights (physical RAM, the cgroup limit, or the accelerator's working set).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
# "auto" KV budget: this share of the memory left beside the weights. A quarter leaves the
# rest to the OS, other processes and the runtime; measured here (24 GiB, SmolLM2-135M
# f32) it is 5.9 GiB, 128 rows of 1,000 tokens, more than 32 rows of full context ever use
# at once with the default max_tokens.
KV_BUDGET_SHARE = 0.25
# "auto" prefix store cap: this share of the KV budget. Entries are whole finished rows
# (8.5 MB each for a 185-token row of SmolLM2-135M f32), kept for reuse; the store gives
# way to running rows anyway, so its cap only bounds what idle time keeps resident.
PREFIX_SHARE = 0.125
PREFIX_CAP_MAX = 1 * GiB  # past this, more entries rarely pay for their lookups
# "auto" MLX buffer cache on an accelerator: this share of the KV budget, 32 MiB to 1 GiB
# (MLX's own default there is its whole memory limit). On CPU, MLX's CPU default (32 MiB):
# its buffers are malloc'd, and a larger cache only kept freed KV resident longer.
BUFFER_CACHE_SHARE = 0.0625
BUFFER_CACHE_MIN = 32 * MiB
BUFFER_CACHE_MAX = 1 * GiB
# Per-step transients above the measured runtime: prefill activations and the logits of a
# full batch, allocated and freed each step (measured below 150 MiB for SmolLM2-135M at
# prefill_batch 8 x 512 tokens, 32 decoding rows).
STEP_ALLOWANCE = 256 * MiB
AUTO_FLOOR = 64 * MiB  # the smallest automatic KV budget, however little memory is left


@dataclass(frozen=True)
class MemoryBounds:
    """The bytes each part of the formula may hold, resolved once the model is loaded."""

    weights_bytes: int
    kv_budget_bytes: int
    prefix_cache_bytes: int
    buffer_cache_bytes: int
    runtime_bytes: int  # resident at load less the weights, plus STEP_ALLOWANCE
    # A vision tower's weights (sized from the checkpoint at load; built at the first image)
    # and its feature LRU's cap.
    vision_bytes: int = 0
    adapter_bytes: int = 0  # the cap of the LoRA adapters loaded at once

    @property
    def resident_bound(self) -> int:
        """What the formula says the process holds at most for this engine."""
        return (self.weights_bytes + self.kv_budget_bytes + self.buffer_cache_bytes
                + self.runtime_bytes + self.vision_bytes + self.adapter_bytes)


def auto_kv_budget(memory_bytes: int, weights_bytes: int) -> int:
    """The default KV budget: a share of the memory left beside the weights."""
    return max(AUTO_FLOOR, int((memory_bytes - weights_bytes) * KV_BUDGET_SHARE))


def auto_prefix_cap(kv_budget_bytes: int) -> int:
    return min(PREFIX_CAP_MAX, int(kv_budget_bytes * PREFIX_SHARE))


def auto_buffer_cache(kv_budget_bytes: int, accelerator: bool = True) -> int:
    if not accelerator:
        return BUFFER_CACHE_MIN
    share = int(kv_budget_bytes * BUFFER_CACHE_SHARE)
    return max(BUFFER_CACHE_MIN, min(BUFFER_CACHE_MAX, share))


def resolve_bounds(kv_budget: int | str | None, prefix_cache: int | str,
                   buffer_cache: int | str, *, memory_bytes: int, weights_bytes: int,
                   resident_at_load: int, accelerator: bool = True) -> MemoryBounds:
    """The settings' ``auto`` values made numbers; ``kv_budget`` None stays unbounded (0).

    The prefix cap is cut to the budget: the scheduler never lets the store hold more.
    """
    machine_budget = auto_kv_budget(memory_bytes, weights_bytes)
    budget = machine_budget if kv_budget == "auto" else kv_budget
    assert budget is None or isinstance(budget, int)
    # The store's auto cap follows the machine, not an explicit budget: a small budget
    # keeps the old behaviour (the store may fill the budget's idle room, giving way first).
    prefix = auto_prefix_cap(machine_budget) if prefix_cache == "auto" else prefix_cache
    assert isinstance(prefix, int)
    if budget is not None:
        prefix = min(prefix, budget)
    if buffer_cache == "auto":
        cache = auto_buffer_cache(budget if budget is not None else machine_budget,
                                  accelerator)
    else:
        assert isinstance(buffer_cache, int)
        cache = buffer_cache
    runtime = max(0, resident_at_load - weights_bytes) + STEP_ALLOWANCE
    return MemoryBounds(weights_bytes, budget or 0, prefix, cache, runtime)


def physical_memory_bytes() -> int:
    """RAM this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max",
                       "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(limit_file).read_text().strip()
            if text != "max":
                total = min(total, int(text))
    return total


def resident_bytes() -> int:
    """The process's resident set now (Linux /proc), else its peak (macOS: in bytes)."""
    with contextlib.suppress(OSError), open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class ResidentSampler:
    """``resident_bytes()`` read at most every ``every`` seconds unless asked fresh: reading
    /proc costs ~50-100 µs, which a decode step on a cheap forward (a GPU's) cannot hide."""

    def __init__(self, every: float = 0.25) -> None:
        self._every = every
        self._value = 0
        self._read_at = -float("inf")

    def read(self, fresh: bool = False) -> int:
        now = time.monotonic()
        if fresh or now - self._read_at >= self._every:
            self._value, self._read_at = resident_bytes(), now
        return self._value


__all__ = ["MemoryBounds", "ResidentSampler", "auto_buffer_cache", "auto_kv_budget",
           "auto_prefix_cap", "physical_memory_bytes", "resident_bytes", "resolve_bounds"]
