"""Giving freed heap memory back to the OS (glibc's ``malloc_trim``), quarantined here.

MLX on CPU allocates arrays with ``malloc``. Freed KV buffers under glibc's mmap threshold
(which rises to 32 MiB once such a buffer is freed) stay in the engine thread's arena, so
the process keeps its high-water mark after a burst; ``malloc_trim(0)`` returns every free
page of every arena. Elsewhere (macOS, musl) there is nothing to call and this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc: no such function
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return free heap pages to the OS; True when there was a ``malloc_trim`` to call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
