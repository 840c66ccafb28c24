"""The Responses store: what ``previous_response_id`` continues from (pure, no I/O).

Each stored response keeps private copies of its input items (the whole history it was
generated from), its output items, its instructions and the response object ``GET``
returns. The store is bounded three ways: a TTL (age since the response was stored), a
byte cap, and least-recently-used order for what the cap evicts. Reading an entry moves it
to the LRU end, so the oldest entry is NOT necessarily first in the map: expiry checks
every entry. The clock is injectable so that all of this is tested on a fake clock.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Clock = Callable[[], float]


@dataclass(frozen=True)
class StoredResponse:
    """One stored response. Its dicts are the store's own copies; ``get`` copies again."""

    id: str
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    instructions: str | None
    response: dict[str, Any]
    stored_at: float = 0.0
    nbytes: int = field(default=0, compare=False)

    def history(self) -> list[dict[str, Any]]:
        """The conversation a continuation starts from: this input, then this output."""
        return copy.deepcopy([*self.input_items, *self.output_items])


def _size(*parts: Any) -> int:
    return sum(len(json.dumps(part, separators=(",", ":"), default=str)) for part in parts)


class ResponseStore:
    """Stored responses bounded by ``ttl_seconds``, ``max_bytes`` and LRU order.

    ``ttl_seconds=None`` keeps entries until the byte cap evicts them. Safe to use from
    several threads (one lock; every operation is short).
    """

    def __init__(self, *, ttl_seconds: float | None = 3600.0, max_bytes: int = 64 << 20,
                 clock: Clock = time.monotonic) -> None:
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0  # entries dropped by the byte cap
        self.expirations = 0  # entries dropped by the TTL

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        with self._lock:
            self._expire()
            return response_id in self._entries

    def put(self, response_id: str, *, input_items: list[dict[str, Any]],
            output_items: list[dict[str, Any]], instructions: str | None,
            response: dict[str, Any]) -> bool:
        """Store copies; False (nothing stored) when the entry alone exceeds the byte cap."""
        nbytes = _size(input_items, output_items, instructions, response)
        if nbytes > self.max_bytes:
            return False
        entry = StoredResponse(response_id, copy.deepcopy(input_items),
                               copy.deepcopy(output_items), instructions,
                               copy.deepcopy(response), self._clock(), nbytes)
        with self._lock:
            self._expire()
            self._drop(response_id)
            self._entries[response_id] = entry
            self._bytes += nbytes
            while self._bytes > self.max_bytes:  # the new entry is last: never itself
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self.evictions += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """A copy of the entry (and a touch: it becomes most recently used), or None."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
        return copy.deepcopy(entry)

    def delete(self, response_id: str) -> bool:
        """Remove an entry; False when it was not there (or had expired)."""
        with self._lock:
            self._expire()
            return self._drop(response_id)

    def expire(self) -> int:
        """Drop every entry older than the TTL now (not one exactly as old); returns how
        many went."""
        with self._lock:
            return self._expire()

    def _expire(self) -> int:
        if self.ttl_seconds is None:
            return 0
        deadline = self._clock() - self.ttl_seconds
        # Every entry, not just the LRU head: a touched old entry sits at the end. An entry
        # exactly as old as the TTL is still alive, as in the store this server follows.
        old = [key for key, entry in self._entries.items() if entry.stored_at < deadline]
        for key in old:
            self._drop(key)
        self.expirations += len(old)
        return len(old)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True
