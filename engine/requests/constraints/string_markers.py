"""A call's structural markers refused inside its argument strings.

A free JSON string may hold any text, the dialect's own call-close marker included: the
default model, deep in an agent's history, wrote a ``city`` of ``Paris, 21 C, ...
}}</tool_call>You can't have ...`` and never closed it. The grammar cannot refuse a
substring inside ``%json`` strings, so this guard does, as the loop guard refuses
repeats (``string_repeats``): it follows the row's bytes, and while they are inside a
string of a call's JSON it names the tokens that would complete one of the markers there.
A model that writes one is steered to close the string and the call instead.

A call's JSON is what follows the dialect's open marker, from its first ``{`` or ``[`` to
where it closes: quotes in reasoning or prose around calls are never read as strings. A
row whose whole output is JSON (a schema's answer) is in that JSON from its first byte.
It depends only on the row's own tokens: greedy stays deterministic, batched equals alone.

Pure: token bytes in, token ids out; no llguidance, no mlx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

_QUOTE = 0x22
_BACKSLASH = 0x5C
_OPENERS = frozenset(b"{[")
_CLOSERS = frozenset(b"}]")


@dataclass(frozen=True)
class MarkerIndex:
    """The tokens that write a marker inside a string, found once per tokenizer and markers.

    ``inside``: tokens that write a whole marker before any quote of theirs (the string
    is still open when it completes); ``completing[(i, k)]``: tokens that begin with the
    rest of marker ``i`` after its first ``k`` bytes (they complete it when the string
    ends with those ``k`` bytes).
    """

    markers: tuple[bytes, ...]
    inside: frozenset[int]
    completing: dict[tuple[int, int], frozenset[int]]

    @classmethod
    def of(cls, token_bytes: Sequence[bytes], markers: Sequence[str]) -> MarkerIndex:
        encoded = tuple(m.encode() for m in markers if m)
        shortest = min((len(m) for m in encoded), default=0)
        inside: set[int] = set()
        by_first: dict[int, list[int]] = {}  # first byte -> tokens: a marker's rest is
        for token, data in enumerate(token_bytes):  # looked up among few, not the vocab
            if not data:
                continue
            by_first.setdefault(data[0], []).append(token)
            if len(data) < shortest:  # too short to hold a whole marker
                continue
            quote = data.find(b'"')
            before_quote = data if quote < 0 else data[:quote]
            if any(marker in before_quote for marker in encoded):
                inside.add(token)
        completing: dict[tuple[int, int], frozenset[int]] = {}
        for i, marker in enumerate(encoded):
            for k in range(1, len(marker)):
                rest = marker[k:]
                found = frozenset(token for token in by_first.get(rest[0], ())
                                  if token_bytes[token].startswith(rest))
                if found:
                    completing[(i, k)] = found
        return cls(encoded, frozenset(inside), completing)


@dataclass
class StringMarkers:
    """One row's place in its calls' JSON, and the tokens refused there now."""

    token_bytes: Sequence[bytes]
    index: MarkerIndex
    opener: bytes  # the dialect's call-open marker; empty: the output is JSON throughout
    _depth: int = 0  # open objects and arrays of the call's JSON (0: not in one)
    _in_string: bool = False
    _escaped: bool = False
    _seen: bytearray = field(default_factory=bytearray)  # recent bytes outside the JSON
    _tail: bytearray = field(default_factory=bytearray)  # the open string's last bytes
    _armed: bool = False  # the opener was written: the next ``{`` or ``[`` starts a call

    def __post_init__(self) -> None:
        self._armed = not self.opener

    def copy(self) -> StringMarkers:
        """An independent copy of the state (a grammar's rollback point)."""
        return StringMarkers(self.token_bytes, self.index, self.opener, self._depth,
                             self._in_string, self._escaped, bytearray(self._seen),
                             bytearray(self._tail), self._armed)

    @property
    def in_string(self) -> bool:
        return self._in_string

    def advance(self, token: int) -> None:
        """Follow one written token."""
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        for byte in data:
            self._byte(byte)

    def _byte(self, byte: int) -> None:
        if self._depth == 0:
            if self._armed and byte in _OPENERS:
                self._depth = 1
                self._seen.clear()
                return
            self._seen.append(byte)
            if self.opener and self._seen.endswith(self.opener):
                self._armed = True
            del self._seen[:max(0, len(self._seen) - len(self.opener))]
            return
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif byte == _BACKSLASH:
                self._escaped = True
            elif byte == _QUOTE:
                self._in_string = False
                self._tail.clear()
                return
            self._tail.append(byte)
            longest = max((len(m) for m in self.index.markers), default=1)
            del self._tail[:max(0, len(self._tail) - longest)]
        elif byte == _QUOTE:
            self._in_string = True
        elif byte in _OPENERS:
            self._depth += 1
        elif byte in _CLOSERS:
            self._depth -= 1
            if self._depth == 0:
                self._armed = not self.opener  # the next call waits for its opener

    def refused(self) -> list[int]:
        """Tokens that would complete a marker inside the open string (none elsewhere)."""
        if not self._in_string:
            return []
        refused = set(self.index.inside)
        tail = bytes(self._tail)
        for i, marker in enumerate(self.index.markers):
            for k in range(1, len(marker)):
                if tail.endswith(marker[:k]):
                    refused |= self.index.completing.get((i, k), frozenset())
        return sorted(refused)
