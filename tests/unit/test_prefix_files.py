"""The disk tier's files (no mlx): whole entries read back, anything else refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.core.prefix_files import (
    EntryFileError,
    EntryHeader,
    file_name,
    read_entry,
    read_header,
    write_entry,
)

KEY = "k" * 64
TOKENS = tuple(range(100, 140))


def entry(tmp_path: Path, key: str = KEY) -> tuple[Path, list[np.ndarray]]:
    arrays = [np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.ones((5,), np.uint16)]
    header = EntryHeader(key, TOKENS, False,
                         ({"kind": "ArraysCache", "arrays": [0, 1]},),
                         tuple(("float32" if a.dtype == np.float32 else "bfloat16",
                                a.shape, a.nbytes) for a in arrays))
    path = tmp_path / file_name(TOKENS)
    write_entry(path, header, [memoryview(a) for a in arrays])
    return path, arrays


def test_an_entry_reads_back_byte_for_byte(tmp_path: Path) -> None:
    path, arrays = entry(tmp_path)
    header, raw = read_entry(path, KEY)
    assert header.tokens == TOKENS and not header.trimmable
    assert header.layers == ({"kind": "ArraysCache", "arrays": [0, 1]},)
    assert [bytes(r) for r in raw] == [a.tobytes() for a in arrays]
    assert read_header(path, KEY).tokens == TOKENS
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, renamed


@pytest.mark.parametrize("damage", ["truncated", "altered", "empty", "garbage"])
def test_a_damaged_file_is_refused(tmp_path: Path, damage: str) -> None:
    path, _ = entry(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 7]
    elif damage == "altered":
        data[len(data) // 2] ^= 0x40
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not an entry at all" * 10)
    path.write_bytes(bytes(data))
    with pytest.raises(EntryFileError):
        read_entry(path, KEY)


def test_a_file_written_under_another_key_is_refused(tmp_path: Path) -> None:
    path, _ = entry(tmp_path, key="another model")
    with pytest.raises(EntryFileError, match="another model"):
        read_header(path, KEY)
    with pytest.raises(EntryFileError):
        read_entry(path, KEY)


def test_a_renamed_file_is_refused(tmp_path: Path) -> None:
    path, _ = entry(tmp_path)
    moved = path.rename(tmp_path / file_name(TOKENS[:-1]))
    with pytest.raises(EntryFileError, match="name"):
        read_entry(moved, KEY)
