"""Prefix reuse for the batch lane: what can be reused, copies, and the store.

Every cache kind is reused, at the lengths it can be resumed from
(``engine.device.rows.row_cache``):

- ``TRIM`` (plain KV caches only): any shared length, from a stored entry or a row
  running now;
- ``BOUNDARY`` (sliding windows, state caches, any mix with plain KV): an entry is
  resumed at its whole length, or at any shorter one while every layer can still be cut
  back (a window that has not wrapped). So the lane stores snapshots at the boundaries a
  later request starts from: the end of a shared head, the end of each prompt, and the
  end of each row (its answer as the next turn renders it back).

Quantized KV is never reused (those rows run on the serial lane). A hit hands the row
new cache objects over the stored arrays, so nothing a row writes can reach the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engine.core.footprint import ModelFootprint
from engine.core.prefix_cache import PrefixHit, PrefixStore, common_prefix
from engine.device.prefix.prefix_disk import PrefixDisk
from engine.device.rows.row_cache import copied, cut_to, cuttable, nbytes

TRIM = "trim"  # plain KV: any shared length, running rows donate
BOUNDARY = "boundary"  # stored snapshots, resumed where every layer allows
OFF = "off"

# Cache kinds the store can hold (by the footprint's names), and what limits each.
_PLAIN = frozenset({"KVCache"})
_BOUNDED = frozenset({"KVCache", "RotatingKVCache", "ArraysCache"})


def reuse_policy(footprint: ModelFootprint) -> str:
    # Quantized plain KV (``kv_bits``: "KVCache(8-bit)") cuts and resumes as plain KV does.
    kinds = {"KVCache" if layer.kind.startswith("KVCache(") else layer.kind
             for layer in footprint.layers}
    if kinds <= _PLAIN:
        return TRIM
    if kinds <= _BOUNDED:
        return BOUNDARY
    return OFF


def cache_nbytes(cache: Sequence[Any]) -> int:
    return nbytes(cache)


class PrefixReuse:
    """Looks up, copies and stores prefixes; the running rows are searched too."""

    def __init__(self, store: PrefixStore, policy: str, disk: PrefixDisk | None = None) -> None:
        self.store = store
        self.policy = policy
        self.disk = disk if policy != OFF else None  # entries written behind the store

    @property
    def enabled(self) -> bool:
        return self.policy != OFF and self.store.max_bytes > 0

    @property
    def snapshots(self) -> bool:
        """Whether the lane should store a row's state at the end of its prompt too: a
        cache that cannot be cut back is reused only where a snapshot was taken."""
        return self.enabled and self.policy == BOUNDARY

    def lookup(
        self, prompt: Sequence[int], running: Mapping[int, Sequence[int]],
        extract: Callable[[int], tuple[Sequence[Any], Sequence[int]] | None],
    ) -> tuple[list[Any], int] | None:
        """(cache for the prompt's first n tokens, n) from the store or a running row."""
        if not self.enabled:
            return None
        hit = self.store.lookup(prompt, record=False)
        best = hit.tokens if hit is not None else 0
        donor = None
        if self.policy == TRIM:
            for request_id, tokens in running.items():
                shared = _shared(tokens, prompt)
                if shared > max(best, self.store.min_tokens - 1):
                    best, donor = shared, request_id
        if donor is not None:
            taken = extract(donor)
            if taken is not None:
                cache, tokens = taken
                n = min(best, len(tokens))
                resumed = cut_to(cache, n, len(tokens)) if n >= self.store.min_tokens else None
                if resumed is not None:
                    self._count(n)
                    return resumed, n
        if self.disk is not None:
            from_disk = self._from_disk(prompt, best)
            if from_disk is not None:
                return from_disk
        if hit is None:
            self.store.stats.misses += 1
            return None
        resumed = cut_to(hit.entry.cache, hit.tokens, len(hit.entry))
        if resumed is None:  # the store's own rule says this cannot happen: count a miss
            self.store.stats.misses += 1
            return None
        self.store.touch(hit.entry)
        self._count(hit.tokens)
        return resumed, hit.tokens

    def _from_disk(self, prompt: Sequence[int], best: int) -> tuple[list[Any], int] | None:
        """A longer prefix than memory holds, read back from disk into the memory store."""
        assert self.disk is not None
        found = self.disk.lookup(prompt)
        if found is None or found.tokens <= best:
            return None
        loaded = self.disk.load(found)
        if loaded is None:
            return None
        tokens, cache, trimmable = loaded
        resumed = cut_to(cache, found.tokens, len(tokens))
        if resumed is None:
            return None
        self.store.insert(tokens, cache, cache_nbytes(cache), trimmable=trimmable)
        self._count(found.tokens)
        return resumed, found.tokens

    def tick(self) -> None:
        """A step ended (entries stored before it are computed: the disk may take them)."""
        if self.disk is not None:
            self.disk.tick()

    def flush(self) -> None:
        """Hand every stored entry to the disk writer now (idle, or closing)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Write what the disk was offered, and stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def covered(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` the store already holds (no stats)."""
        hit: PrefixHit | None = self.store.lookup(prompt, record=False)
        return hit.tokens if hit is not None else 0

    def keep(self, tokens: Sequence[int], cache: Sequence[Any]) -> None:
        """Store the state of ``tokens`` (a row's whole cache, which holds exactly them)."""
        if self.enabled and len(tokens) >= self.store.min_tokens and len(cache):
            stored = copied(cache)
            trimmable = cuttable(stored)
            entry = self.store.insert(list(tokens), stored, cache_nbytes(stored),
                                      trimmable=trimmable)
            if self.disk is not None and entry is not None and len(entry) == len(tokens):
                self.disk.offer(tokens, stored, trimmable)

    def keep_prefix(self, tokens: Sequence[int], cache: Sequence[Any], n: int) -> None:
        """Store the state of the first ``n`` of ``tokens`` (the cache holds them all),
        if every layer can be cut back there."""
        if not self.enabled or n < self.store.min_tokens:
            return
        resumed = cut_to(cache, n, len(tokens))
        if resumed is not None:
            self.keep(tokens[:n], resumed)

    def _count(self, tokens: int) -> None:
        self.store.stats.hits += 1
        self.store.stats.hit_tokens += tokens


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    # Leave at least one prompt token to prefill: the model must see it to give logits.
    return min(common_prefix(np.asarray(a), np.asarray(b)), len(b) - 1)
