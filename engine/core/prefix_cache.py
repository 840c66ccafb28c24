"""A store of reusable KV prefixes: longest-prefix lookup, LRU, TTL, and a byte cap.

Pure bookkeeping (numpy for the token comparisons, no mlx): the cache objects are
opaque to this module and their sizes are given by the caller. Time comes from an
injectable ``now()`` so tests control it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(eq=False)  # identity: entries hold arrays, and two may hold equal tokens
class PrefixEntry:
    """The KV state of ``tokens`` (all of them), stored at ``stored_at``."""

    tokens: np.ndarray[Any, np.dtype[np.int64]]
    cache: Any
    nbytes: int
    stored_at: float
    last_used: float
    trimmable: bool = True  # False: recurrent state, reusable only on an exact boundary

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    expirations: int = 0


@dataclass
class PrefixHit:
    """A lookup result: reuse the first ``tokens`` tokens of ``entry``."""

    entry: PrefixEntry
    tokens: int


def common_prefix(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixStore:
    """Entries keyed by their token sequences; bounded by bytes, count and age."""

    def __init__(self, max_bytes: int, ttl: float | None, *, min_tokens: int = 16,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.min_tokens = min_tokens
        self._now = now
        self._entries: list[PrefixEntry] = []  # least recently used first
        self.stats = PrefixStats()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], *, record: bool = True) -> PrefixHit | None:
        """The entry sharing the longest usable prefix with ``tokens``.

        At least one prompt token is always left to prefill (the model must see the
        last one to produce logits), so an entry covering the whole prompt yields
        ``len(tokens) - 1`` when it can be trimmed.
        """
        self.expire()
        query = np.asarray(tokens, dtype=np.int64)
        best: PrefixHit | None = None
        for entry in self._entries:
            shared = min(common_prefix(entry.tokens, query), len(query) - 1)
            if not entry.trimmable and shared != len(entry):
                continue  # recurrent state cannot be cut back to an earlier position
            if shared >= self.min_tokens and (best is None or shared > best.tokens):
                best = PrefixHit(entry, shared)
        if record:
            if best is None:
                self.stats.misses += 1
            else:
                self.touch(best.entry)
                self.stats.hits += 1
                self.stats.hit_tokens += best.tokens
        return best

    def touch(self, entry: PrefixEntry) -> None:
        entry.last_used = self._now()
        self._entries.remove(entry)
        self._entries.append(entry)

    def insert(self, tokens: Sequence[int], cache: Any, nbytes: int,
               trimmable: bool = True) -> PrefixEntry | None:
        """Store a prefix; entries it makes redundant are dropped. None if not worth it."""
        if len(tokens) < self.min_tokens or nbytes > self.max_bytes:
            return None
        array = np.asarray(tokens, dtype=np.int64)
        for entry in list(self._entries):
            shared = common_prefix(entry.tokens, array)
            if shared == len(entry) and (trimmable or shared == len(array)):
                self._entries.remove(entry)  # a prefix of the new one: it covers it
            elif shared == len(array) and entry.trimmable:
                self.touch(entry)  # already covered by a longer entry
                return entry
        now = self._now()
        entry = PrefixEntry(array, cache, nbytes, now, now, trimmable)
        self._entries.append(entry)
        self.shrink_to(self.max_bytes)
        return entry if entry in self._entries else None

    def expire(self) -> int:
        """Drop every entry older than the TTL.

        Checks EVERY entry: LRU order is recency of use, not age, so an oldest-first
        walk that stops at the first fresh entry would leave expired ones behind.
        """
        if self.ttl is None:
            return 0
        cutoff = self._now() - self.ttl
        expired = [e for e in self._entries if e.stored_at <= cutoff]
        for entry in expired:
            self._entries.remove(entry)
        self.stats.expirations += len(expired)
        return len(expired)

    def shrink_to(self, max_bytes: int) -> int:
        """Evict least recently used entries until at most ``max_bytes`` are held."""
        freed = 0
        while self._entries and self.nbytes > max_bytes:
            freed += self._entries.pop(0).nbytes
            self.stats.evictions += 1
        return freed

    def remove(self, entry: PrefixEntry) -> None:
        """Drop one entry (its bytes are no longer held)."""
        if entry in self._entries:
            self._entries.remove(entry)

    def clear(self) -> None:
        self._entries.clear()

    def entries(self) -> list[PrefixEntry]:
        return list(self._entries)


__all__ = ["PrefixEntry", "PrefixHit", "PrefixStats", "PrefixStore", "common_prefix"]
