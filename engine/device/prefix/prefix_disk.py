"""The prefix store's disk tier: entries that survive a restart (``prefix_cache_dir``).

Agents restart between runs and prefill the same long system prompt and tool list again
each time. With a directory set, every entry the memory store keeps is also written to
disk, behind it:

- **Never in the step's way.** The engine thread only hands over views of arrays it has
  already computed (an entry's copy is evaluated with the step after it was stored); a
  writer thread of its own does the file work. If writes fall behind, new entries are
  skipped, never waited for.
- **Keyed.** Files live under a directory named by a digest of the model's files (config,
  tokenizer, weights sampled at both ends), its cache layout and the engine's, mlx's and
  mlx-lm's versions; each file repeats the whole key. Another model, tokenizer, layout or
  version never reads them.
- **Lazy.** At start only the files' headers (their tokens) are read; an entry's arrays
  are read when a prompt would reuse more from it than from memory, then it joins the
  memory store like any other entry.
- **Checked.** A short, altered or foreign file is skipped with a warning and removed:
  never a crash, never different tokens.
- **Bounded** by ``prefix_cache_disk_bytes``: least recently used files go first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from engine.core.prefix_cache import PrefixEntry, PrefixHit, PrefixStore
from engine.core.prefix_files import (
    SUFFIX,
    EntryFileError,
    EntryHeader,
    file_name,
    read_entry,
    read_header,
    write_entry,
)
from engine.core.reuse_key import KEY_VERSION
from engine.device.rows.row_cache import arrays_of
from engine.device.upstream.quantized_kv import RowQuantizedKVCache

log = logging.getLogger("engine")

FORMAT = 1  # bump when what a file means changes: older files are then never read
_SAMPLE = 1 << 20  # bytes read from each end of a weights file for the key
_WRITE_BACKLOG = 512 << 20  # most bytes waiting for the writer; more entries are skipped

_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.float32: ("float32", np.float32), mx.float16: ("float16", np.float16),
    mx.bfloat16: ("bfloat16", np.uint16), mx.int32: ("int32", np.int32),
    mx.int64: ("int64", np.int64), mx.uint32: ("uint32", np.uint32),
    mx.int8: ("int8", np.int8), mx.uint8: ("uint8", np.uint8), mx.bool_: ("bool", np.bool_),
}
_BY_NAME = {name: (dtype, np_type) for dtype, (name, np_type) in _DTYPES.items()}


def disk_key(model_path: Path, layout: Sequence[Any], kv: str = "") -> str:
    """What a file must have been written under to be read: the model's files, its cache
    layout, the dtype its KV is kept in (``kv``: ``EngineConfig.kv_dtype``, "" for the
    model's own), the versions of the engine, mlx and mlx-lm, and what a reuse key means."""
    digest = hashlib.sha256(f"format {FORMAT}\nreuse key {KEY_VERSION}\n".encode())
    if kv:  # files of the model's own dtype keep their key
        digest.update(f"kv {kv}\n".encode())
    for package in ("mlx-providers", "mlx", "mlx-lm"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        digest.update(f"{package} {version}\n".encode())
    digest.update(repr([_layout(layer) for layer in layout]).encode())
    for path in sorted(p for p in Path(model_path).iterdir() if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name} {size}\n".encode())
        with open(path, "rb") as source:
            if size <= 4 * _SAMPLE:
                digest.update(source.read())
            else:  # weights: both ends identify them without reading gigabytes
                digest.update(source.read(_SAMPLE))
                source.seek(size - _SAMPLE)
                digest.update(source.read(_SAMPLE))
    return digest.hexdigest()


def _layout(layer: Any) -> Any:
    if isinstance(layer, CacheList):
        return ["CacheList", [_layout(child) for child in layer.caches]]
    if isinstance(layer, RotatingKVCache):
        return ["RotatingKVCache", int(layer.max_size), int(layer.keep)]
    if isinstance(layer, RowQuantizedKVCache):  # files of another kv_bits never match
        return ["RowQuantizedKVCache", int(layer.bits), int(layer.group_size)]
    return [type(layer).__name__]


# ----- caches as (header layers, arrays) and back ------------------------------------------


def _encode(layer: Any, arrays: list[mx.array]) -> dict[str, Any]:
    def slot(array: mx.array | None) -> int | None:
        if array is None:
            return None
        arrays.append(array)
        return len(arrays) - 1

    if isinstance(layer, RowQuantizedKVCache):
        keys, values = layer.keys or (None,) * 3, layer.values or (None,) * 3
        return {"kind": "QuantizedKV", "offset": int(layer.offset), "bits": int(layer.bits),
                "group_size": int(layer.group_size),
                "arrays": [slot(a) for a in (*keys, *values)]}
    if isinstance(layer, KVCache):
        return {"kind": "KVCache", "offset": int(layer.offset),
                "arrays": [slot(layer.keys), slot(layer.values)]}
    if isinstance(layer, RotatingKVCache):
        return {"kind": "RotatingKVCache", "offset": int(layer.offset),
                "max_size": int(layer.max_size), "keep": int(layer.keep),
                "idx": int(layer._idx), "arrays": [slot(layer.keys), slot(layer.values)]}
    if isinstance(layer, ArraysCache):
        return {"kind": "ArraysCache", "arrays": [slot(a) for a in layer.cache]}
    if isinstance(layer, CacheList):
        return {"kind": "CacheList", "children": [_encode(c, arrays) for c in layer.caches]}
    raise TypeError(f"{type(layer).__name__} cannot be written to disk")


def _decode(spec: dict[str, Any], arrays: list[mx.array]) -> Any:
    def take(index: int | None) -> mx.array | None:
        return None if index is None else arrays[index]

    kind = spec["kind"]
    if kind == "QuantizedKV":
        row = RowQuantizedKVCache(group_size=int(spec["group_size"]), bits=int(spec["bits"]))
        parts = [take(i) for i in spec["arrays"]]
        if all(p is not None for p in parts):
            row.keys = (parts[0], parts[1], parts[2])  # type: ignore[assignment]
            row.values = (parts[3], parts[4], parts[5])  # type: ignore[assignment]
        row.offset = int(spec["offset"])
        return row
    if kind == "KVCache":
        kv = KVCache()
        kv.keys, kv.values = take(spec["arrays"][0]), take(spec["arrays"][1])
        kv.offset = int(spec["offset"])
        return kv
    if kind == "RotatingKVCache":
        ring = RotatingKVCache(int(spec["max_size"]), int(spec["keep"]))
        ring.keys, ring.values = take(spec["arrays"][0]), take(spec["arrays"][1])
        ring.offset, ring._idx = int(spec["offset"]), int(spec["idx"])
        return ring
    if kind == "ArraysCache":
        state = ArraysCache(len(spec["arrays"]))
        state.cache = [take(i) for i in spec["arrays"]]
        return state
    if kind == "CacheList":
        return CacheList(*(_decode(child, arrays) for child in spec["children"]))
    raise EntryFileError(f"unknown cache kind {kind!r}")


def _array_from(raw: bytes, dtype: str, shape: tuple[int, ...]) -> mx.array:
    if dtype not in _BY_NAME:
        raise EntryFileError(f"unknown dtype {dtype!r}")
    mx_type, np_type = _BY_NAME[dtype]
    host = np.frombuffer(raw, dtype=np_type)
    if host.size != int(np.prod(shape, dtype=np.int64)):
        raise EntryFileError(f"{len(raw)} bytes do not make a {dtype} array of {shape}")
    array = mx.array(host.reshape(shape))
    return array.view(mx_type) if mx_type == mx.bfloat16 else array


# ----- the tier ----------------------------------------------------------------------------


@dataclass
class DiskStats:
    hits: int = 0  # entries read back from disk for a prompt
    hit_tokens: int = 0
    written: int = 0  # entries written
    skipped: int = 0  # files refused (short, altered, foreign) and removed
    write_failures: int = 0


@dataclass
class _Offer:
    tokens: list[int]
    cache: list[Any]
    trimmable: bool
    tick: int


@dataclass
class _Job:
    name: str
    header: EntryHeader
    buffers: list[memoryview]
    arrays: list[mx.array] = field(default_factory=list)  # kept alive until written

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.header.arrays)


class PrefixDisk:
    """One engine's disk tier under ``root``: the index on the engine thread, a writer."""

    def __init__(self, root: Path, key: str, max_bytes: int, min_tokens: int) -> None:
        self.key = key
        self.dir = Path(root) / key[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index: the engine thread reads, the writer adds
        self._index = PrefixStore(max_bytes, None, min_tokens=min_tokens)
        self._offers: list[_Offer] = []
        self._ticks = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._backlog = 0  # bytes handed to the writer and not yet written
        self._warned_write = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-writer",
                                         daemon=True)
        self._writer.start()

    # ----- the engine thread ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._index.nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The file sharing the longest usable prefix with ``prompt`` (nothing read)."""
        with self._lock:
            return self._index.lookup(prompt, record=False)

    def load(self, hit: PrefixHit) -> tuple[list[int], list[Any], bool] | None:
        """Read a hit's entry: (its tokens, its cache, whether it can be cut back), or None
        when the file is gone or refused (then it is removed, with a warning)."""
        name = hit.entry.cache
        path = self.dir / name
        try:
            header, raw = read_entry(path, self.key)
            arrays = [_array_from(data, dtype, shape)
                      for data, (dtype, shape, _) in zip(raw, header.arrays)]
            cache = [_decode(spec, arrays) for spec in header.layers]
        except FileNotFoundError:  # evicted meanwhile (another engine on the same directory)
            self._forget(name)
            return None
        except (EntryFileError, OSError, ValueError, IndexError, KeyError, TypeError) as exc:
            log.warning("prefix cache: skipping %s: %s", path, exc)
            self.stats.skipped += 1
            self._forget(name, unlink=True)
            return None
        mx.async_eval(arrays)  # type: ignore[no-untyped-call]
        with self._lock:
            self._index.touch(hit.entry)
        try:
            os.utime(path)  # least recently used order survives a restart
        except OSError:
            pass
        self.stats.hits += 1
        self.stats.hit_tokens += hit.tokens
        return list(header.tokens), cache, header.trimmable

    def offer(self, tokens: Sequence[int], cache: Sequence[Any], trimmable: bool) -> None:
        """An entry the memory store has just kept (its copies computed asynchronously)."""
        self._offers.append(_Offer(list(tokens), list(cache), trimmable, self._ticks))

    def tick(self) -> None:
        """A step ended: entries offered before it are computed; hand them to the writer."""
        self._ticks += 1
        ready = [o for o in self._offers if o.tick < self._ticks - 1]
        if ready:
            self._offers = [o for o in self._offers if o.tick >= self._ticks - 1]
            self._hand_over(ready)

    def flush(self) -> None:
        """Hand every offered entry to the writer now (when idle, or closing)."""
        offers, self._offers = self._offers, []
        if offers:
            mx.eval([arrays_of(o.cache) for o in offers])
            self._hand_over(offers)

    def close(self, timeout: float = 30.0) -> None:
        """Write what was offered, then stop the writer (at most ``timeout`` seconds)."""
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout)

    def _hand_over(self, offers: list[_Offer]) -> None:
        for offer in offers:
            name = file_name(offer.tokens)
            with self._lock:
                known = any(entry.cache == name for entry in self._index.entries())
            if known:
                continue
            arrays: list[mx.array] = []
            try:
                layers = tuple(_encode(layer, arrays) for layer in offer.cache)
                specs = tuple((_DTYPES[a.dtype][0], tuple(a.shape), int(a.nbytes))
                              for a in arrays)
            except (TypeError, KeyError):  # a cache kind or dtype files do not describe
                continue
            job = _Job(name, EntryHeader(self.key, tuple(offer.tokens), offer.trimmable,
                                         layers, specs),
                       [memoryview(a) for a in arrays],  # type: ignore[arg-type]
                       arrays)  # computed already: no wait here
            with self._lock:
                if self._backlog + job.nbytes > min(_WRITE_BACKLOG, self.max_bytes):
                    continue  # the writer is behind: this entry stays in memory only
                self._backlog += job.nbytes
            self._queue.put(job)

    def _forget(self, name: str, unlink: bool = False) -> None:
        with self._lock:
            for entry in self._index.entries():
                if entry.cache == name:
                    self._index.remove(entry)
        if unlink:
            (self.dir / name).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Index the directory's files by their headers, oldest use first."""
        stale = time.time() - 3600
        for tmp in self.dir.glob(".*.tmp"):  # a writer killed mid-file, long ago
            try:
                if tmp.stat().st_mtime < stale:
                    tmp.unlink()
            except OSError:
                pass
        files = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                files.append((path.stat().st_mtime, path))
            except OSError:
                continue
        for _, path in sorted(files):
            try:
                header = read_header(path, self.key)
                size = path.stat().st_size
            except (EntryFileError, OSError) as exc:
                log.warning("prefix cache: skipping %s: %s", path, exc)
                self.stats.skipped += 1
                path.unlink(missing_ok=True)
                continue
            self._add(list(header.tokens), path.name, size, header.trimmable)

    def _add(self, tokens: list[int], name: str, size: int, trimmable: bool) -> None:
        """Index a written file; files the index drops (covered, or over the cap) go."""
        with self._lock:
            before = {entry.cache for entry in self._index.entries()}
            self._index.insert(tokens, name, size, trimmable=trimmable)
            after = {entry.cache for entry in self._index.entries()}
        for gone in (before | {name}) - after:
            (self.dir / gone).unlink(missing_ok=True)

    # ----- the writer thread (no mlx: plain buffers) ----------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                size = write_entry(self.dir / job.name, job.header, job.buffers)
                self._add(list(job.header.tokens), job.name, size, job.header.trimmable)
                self.stats.written += 1
            except Exception as exc:  # a full disk, a permission: memory reuse goes on
                self.stats.write_failures += 1
                if not self._warned_write:
                    self._warned_write = True
                    log.warning("prefix cache: cannot write to %s: %r", self.dir, exc)
            finally:
                with self._lock:
                    self._backlog -= job.nbytes
                job.buffers.clear()
                job.arrays.clear()


__all__ = ["DiskStats", "PrefixDisk", "PrefixEntry", "disk_key"]
