"""Reading and patching the dynamic symbol tables of 64-bit little-endian ELF images.

Used by ``engine._platform.blas`` to (1) rename ``scipy_``-prefixed exports of the PyPI OpenBLAS
wheel to the plain names libmlx imports, and (2) find libmlx's GOT slot for a symbol, to
check which library it is really bound to. Pure Python, no mlx.
"""

from __future__ import annotations

import mmap
import struct

_DT_NULL, _DT_PLTRELSZ, _DT_STRTAB, _DT_SYMTAB = 0, 2, 5, 6
_DT_RELA, _DT_RELASZ, _DT_JMPREL, _DT_GNU_HASH = 7, 8, 23, 0x6FFFFEF5
_PT_LOAD, _PT_DYNAMIC = 1, 2
_SYM_SIZE, _RELA_SIZE = 24, 24
# R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT, R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT
_GOT_RELOCS = frozenset({6, 7, 1025, 1026})


class _Elf:
    """The dynamic section of a 64-bit little-endian ELF image held in memory."""

    def __init__(self, data: bytes | bytearray | mmap.mmap) -> None:
        if bytes(data[:6]) != b"\x7fELF\x02\x01":
            raise ValueError("not a 64-bit little-endian ELF file")
        self.data = data
        (phoff,) = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        self.loads: list[tuple[int, int, int]] = []
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            p_type, _, offset, vaddr, _, filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize
            )
            if p_type == _PT_LOAD:
                self.loads.append((vaddr, offset, filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (offset, filesz)
        if dynamic is None:
            raise ValueError("no PT_DYNAMIC segment")
        self.tags: dict[int, int] = {}
        for tag, value in struct.iter_unpack("<qQ", data[dynamic[0] : dynamic[0] + dynamic[1]]):
            if tag == _DT_NULL:
                break
            self.tags.setdefault(tag, value)

    def offset(self, vaddr: int) -> int:
        for start, offset, size in self.loads:
            if start <= vaddr < start + size:
                return vaddr - start + offset
        raise ValueError(f"address {vaddr:#x} is not in the file")

    def table(self, tag: int) -> int:
        if tag not in self.tags:
            raise ValueError(f"no dynamic tag {tag:#x}")
        return self.offset(self.tags[tag])

    def name(self, st_name: int) -> bytes:
        start = self.table(_DT_STRTAB) + st_name
        return bytes(self.data[start : self.data.find(b"\0", start)])


def _gnu_hash(name: bytes) -> int:
    h = 5381
    for byte in name:
        h = (h * 33 + byte) & 0xFFFFFFFF
    return h


def strip_symbol_prefix(data: bytearray, prefix: bytes) -> int:
    """Rename exported ``<prefix>foo`` to ``foo`` in place; returns how many were renamed.

    The new name is the tail of the old string, so only st_name moves. The GNU hash table
    is rebuilt with ONE bucket: symbols of a bucket must be adjacent in .dynsym, and with one
    bucket they are without reordering (reordering would break every relocation). Lookups
    that pass the (rebuilt) bloom filter then scan ~5k 32-bit hashes: microseconds.
    """
    elf = _Elf(data)
    symtab, gnu_hash = elf.table(_DT_SYMTAB), elf.table(_DT_GNU_HASH)
    nbuckets, symoffset, bloom_size, shift = struct.unpack_from("<IIII", data, gnu_hash)
    buckets_at = gnu_hash + 16 + 8 * bloom_size
    chain_at = buckets_at + 4 * nbuckets
    last = max(struct.unpack_from(f"<{nbuckets}I", data, buckets_at))
    if last < symoffset:
        raise ValueError("the library exports no symbols")
    while not struct.unpack_from("<I", data, chain_at + 4 * (last - symoffset))[0] & 1:
        last += 1  # the chain's last entry carries the low bit
    names = [
        elf.name(struct.unpack_from("<I", data, symtab + _SYM_SIZE * i)[0])
        for i in range(symoffset, last + 1)
    ]
    taken = set(names)
    renamed = 0
    hashes: list[int] = []
    for index, name in enumerate(names, start=symoffset):
        short = name[len(prefix) :]
        if name.startswith(prefix) and short and short not in taken:
            at = symtab + _SYM_SIZE * index
            struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] + len(prefix))
            name, renamed = short, renamed + 1
        hashes.append(_gnu_hash(name))
    bloom = [0] * bloom_size
    for h in hashes:
        bloom[(h // 64) % bloom_size] |= (1 << (h % 64)) | (1 << ((h >> shift) % 64))
    chain = [h & ~1 for h in hashes]
    chain[-1] |= 1
    table = (
        struct.pack("<IIII", 1, symoffset, bloom_size, shift)
        + struct.pack(f"<{bloom_size}Q", *bloom)
        + struct.pack("<I", symoffset)
        + struct.pack(f"<{len(chain)}I", *chain)
    )
    # One bucket instead of nbuckets: always fits in the old table's bytes.
    data[gnu_hash : gnu_hash + len(table)] = table
    return renamed


def got_offset(path: str, symbol: str) -> int:
    """The GOT slot (a load-relative address) through which ``path`` calls ``symbol``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        elf = _Elf(data)
        symtab = elf.table(_DT_SYMTAB)
        wanted = symbol.encode()
        for table_tag, size_tag in ((_DT_JMPREL, _DT_PLTRELSZ), (_DT_RELA, _DT_RELASZ)):
            if table_tag not in elf.tags:
                continue
            start = elf.table(table_tag)
            relocs = data[start : start + elf.tags.get(size_tag, 0)]
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", relocs):
                if (r_info & 0xFFFFFFFF) not in _GOT_RELOCS:
                    continue
                (st_name,) = struct.unpack_from("<I", data, symtab + _SYM_SIZE * (r_info >> 32))
                if elf.name(st_name) == wanted:
                    return int(r_offset)
    raise ValueError(f"{path} has no GOT slot for {symbol}")
