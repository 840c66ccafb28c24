"""The prefix store's disk tier, the pure part: one file per entry, and the index of them.

A file holds one stored prefix: a header (JSON: the key it was written under, its tokens,
whether it can be cut back, each layer's kind and numbers, each array's dtype and shape),
the arrays' raw bytes, and a CRC-32 of everything before it. It is written to a temporary
name and renamed, so a crash leaves no half file under a real name; a file that is short,
altered or written under another key is refused (``EntryFileError``), never read as an
entry. No mlx here: arrays are bytes (buffers), converted by ``engine.device.prefix.prefix_disk``.

The index of the files in a directory is a ``PrefixStore`` (the memory store's own lookup,
LRU and byte cap) whose entries name files instead of holding caches.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"MLXPFX\x00\x01"
SUFFIX = ".prefix"
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class EntryFileError(ValueError):
    """A file that is not a whole entry written under this key (short, altered, foreign)."""


@dataclass(frozen=True)
class EntryHeader:
    """What a file says about the entry it holds."""

    key: str
    tokens: tuple[int, ...]
    trimmable: bool
    layers: tuple[dict[str, Any], ...]  # each layer's kind, numbers and array indices
    arrays: tuple[tuple[str, tuple[int, ...], int], ...]  # (dtype, shape, bytes) each

    def to_json(self) -> bytes:
        return json.dumps({"key": self.key, "tokens": list(self.tokens),
                           "trimmable": self.trimmable, "layers": list(self.layers),
                           "arrays": [[d, list(s), n] for d, s, n in self.arrays]},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> EntryHeader:
        try:
            raw = json.loads(data)
            return cls(str(raw["key"]), tuple(int(t) for t in raw["tokens"]),
                       bool(raw["trimmable"]), tuple(raw["layers"]),
                       tuple((str(d), tuple(int(x) for x in s), int(n))
                             for d, s, n in raw["arrays"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryFileError(f"unreadable header: {exc}") from exc


def file_name(tokens: Sequence[int]) -> str:
    """The entry's file name: a digest of its tokens (one file per distinct prefix)."""
    digest = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:40]
    return f"{len(tokens):07d}-{digest}{SUFFIX}"


def write_entry(path: Path, header: EntryHeader, buffers: Sequence[memoryview]) -> int:
    """Write the entry to ``path`` (atomically: a temporary file, then a rename); bytes."""
    head = header.to_json()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    crc = 0
    written = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in (MAGIC, _LENGTH.pack(len(head)), head):
                out.write(chunk)
                crc = zlib.crc32(chunk, crc)
                written += len(chunk)
            for buffer, (_, _, nbytes) in zip(buffers, header.arrays):
                raw = buffer.cast("B") if buffer.format != "B" else buffer
                if len(raw) != nbytes:
                    raise EntryFileError(f"array of {len(raw)} bytes, header says {nbytes}")
                out.write(raw)
                crc = zlib.crc32(raw, crc)
                written += nbytes
            out.write(_CRC.pack(crc))
            written += _CRC.size
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return written


def read_header(path: Path, key: str) -> EntryHeader:
    """The header of the entry in ``path``, checked to be written under ``key`` (the
    payload is checked when the entry is read)."""
    with open(path, "rb") as source:
        return _header(source.read(len(MAGIC) + _LENGTH.size), source, path, key)


def read_entry(path: Path, key: str) -> tuple[EntryHeader, list[bytes]]:
    """The whole entry: its header and each array's bytes, every byte checked."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + _LENGTH.size + _CRC.size:
        raise EntryFileError(f"{path.name}: truncated ({len(data)} bytes)")
    (stored,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[: len(data) - _CRC.size]) != stored:
        raise EntryFileError(f"{path.name}: checksum mismatch (truncated or altered)")
    start = len(MAGIC) + _LENGTH.size
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    header = _checked(EntryHeader.from_json(data[start:start + length]), path, key)
    offset = start + length
    arrays = []
    for _, _, nbytes in header.arrays:
        arrays.append(data[offset:offset + nbytes])
        offset += nbytes
    if offset != len(data) - _CRC.size:
        raise EntryFileError(f"{path.name}: {len(data) - _CRC.size - offset} bytes unaccounted")
    return header, arrays


def _header(start: bytes, source: Any, path: Path, key: str) -> EntryHeader:
    if len(start) < len(MAGIC) + _LENGTH.size or not start.startswith(MAGIC):
        raise EntryFileError(f"{path.name}: not a prefix entry file")
    (length,) = _LENGTH.unpack_from(start, len(MAGIC))
    if length > 1 << 30:
        raise EntryFileError(f"{path.name}: header of {length} bytes")
    raw = source.read(length)
    if len(raw) != length:
        raise EntryFileError(f"{path.name}: truncated header")
    return _checked(EntryHeader.from_json(raw), path, key)


def _checked(header: EntryHeader, path: Path, key: str) -> EntryHeader:
    if header.key != key:
        raise EntryFileError(f"{path.name}: written for another model, tokenizer, cache "
                             f"layout or engine version")
    if path.name != file_name(header.tokens):
        raise EntryFileError(f"{path.name}: its name does not match its tokens")
    return header


__all__ = ["MAGIC", "SUFFIX", "EntryFileError", "EntryHeader", "file_name", "read_entry",
           "read_header", "write_entry"]
