"""What each speed-up does on the loaded model's caches, or why it is off: ``stats().speedups``.

Read once when the lanes are built, from what they decided: a user reading ``stats()`` or
``/metrics`` sees "on, rejected drafts rolled back (state caches)" or "off: quantized KV
caches do not merge into a batch", never a bare 0 to puzzle over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import CacheList

from engine.core.stats import SpeedUp
from engine.device.prefix.prefix_reuse import BOUNDARY, TRIM
from engine.device.upstream.quantized_kv import RowQuantizedKVCache

_STATE = "ArraysCache"
_RING = "RotatingKVCache"


def cache_kinds(cache: Sequence[Any]) -> tuple[str, ...]:
    """The distinct cache classes of a model's layers (lists of caches flattened)."""
    kinds: set[str] = set()
    for layer in cache:
        if isinstance(layer, CacheList):
            kinds.update(cache_kinds(layer.caches))
        elif isinstance(layer, RowQuantizedKVCache):  # kv_bits: plain KV, quantized
            kinds.add(f"KVCache({layer.bits}-bit)")
        else:
            kinds.add(type(layer).__name__)
    return tuple(sorted(kinds))


def report(kinds: Sequence[str], *, serial: bool, fast_forward: bool, fast_forward_asked: bool,
           speculation: int, speculation_asked: int, trims: bool, reuse_policy: str,
           reuse_bytes: int, sharded: bool, disk: str | None,
           disk_off: str | None) -> tuple[SpeedUp, ...]:
    """The four speed-ups as the lanes were built (``*_asked``: the settings)."""
    odd = [kind for kind in kinds
           if kind not in ("KVCache", _RING, _STATE) and not kind.startswith("KVCache(")]
    unsupported = f"{', '.join(odd)} caches do not merge into a batch" if odd else ""
    return (_fast_forward(serial, fast_forward, fast_forward_asked, unsupported),
            _speculation(kinds, serial, speculation, speculation_asked, trims, unsupported),
            _reuse(kinds, serial, reuse_policy, reuse_bytes, sharded, unsupported),
            _disk(disk, disk_off))


def _fast_forward(serial: bool, on: bool, asked: bool, unsupported: str) -> SpeedUp:
    if not asked:
        return SpeedUp("fast_forward", False, "off: fast_forward=False")
    if serial:
        return SpeedUp("fast_forward", True, "forced tokens fed with the sampled one "
                                             "(serial lane: each row its own cache)")
    if not on:
        return SpeedUp("fast_forward", False, f"off: {unsupported}")
    return SpeedUp("fast_forward", True, "forced spans fed in one forward; every cache kind "
                                         "advances through a span as through a prompt chunk")


def _speculation(kinds: Sequence[str], serial: bool, on: int, asked: int, trims: bool,
                 unsupported: str) -> SpeedUp:
    if asked <= 0:
        return SpeedUp("speculation", False, "off: speculation=0")
    if serial:
        return SpeedUp("speculation", False, "off: rows run on the serial lane "
                                             f"({unsupported or 'caches do not merge'})")
    if on <= 0:
        return SpeedUp("speculation", False, f"off: {unsupported}")
    how = ("rejected drafts trimmed" + (" (sliding windows cut to their kept keys)"
                                        if _RING in kinds else "")
           if trims else "rejected drafts rolled back to the state before the check, "
                         "accepted tokens fed again with the next one (state caches)")
    return SpeedUp("speculation", True, f"greedy rows while at most {on} run; {how}")


def _reuse(kinds: Sequence[str], serial: bool, policy: str, max_bytes: int, sharded: bool,
           unsupported: str) -> SpeedUp:
    if sharded:
        return SpeedUp("prefix_reuse", False, "off: sharded engine (ranks must agree)")
    if max_bytes <= 0:
        return SpeedUp("prefix_reuse", False, "off: prefix_cache_bytes=0")
    if serial or policy not in (TRIM, BOUNDARY):
        return SpeedUp("prefix_reuse", False, f"off: {unsupported or 'serial lane'}")
    if policy == TRIM:
        return SpeedUp("prefix_reuse", True, "any shared length (plain KV); running rows "
                                             "donate their prefixes")
    limits = []
    if _RING in kinds:
        limits.append("sliding windows cut back until they wrap")
    if _STATE in kinds:
        limits.append("state caches resumed exactly where stored")
    return SpeedUp("prefix_reuse", True, "snapshots at the end of each shared head, prompt "
                                         f"and answer; {', '.join(limits)}")


def _disk(disk: str | None, off: str | None) -> SpeedUp:
    """``off``: why the directory asked for is not used (None: it is)."""
    if disk is None:
        return SpeedUp("prefix_disk", False, "off: prefix_cache_dir not set")
    if off is not None:
        return SpeedUp("prefix_disk", False, f"off: {off or 'not used'}")
    return SpeedUp("prefix_disk", True, f"entries written behind the store to {disk}")
