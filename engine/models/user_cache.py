"""The per-user cache: where converted models and downloads live, and how they get there.

Conversions are published atomically: a converter writes into a temporary sibling
directory and renames it into place, so a crash never leaves a half-written model that a
later run would load. Concurrent processes serialise on an advisory lock file per entry,
and a process that loses a rename race keeps the winner's copy. ``mlx`` is imported only
inside functions: another module must load a BLAS library before ``mlx.core`` is first
imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from engine.models.gguf import FloatDtype, convert_gguf

CACHE_ENV_VAR = "MLX_PROVIDERS_CACHE"
# Bumped whenever engine.models.gguf's output changes, so that stale conversions are not reused.
CONVERTER_VERSION = 1

_SAMPLE_COUNT, _SAMPLE_BYTES, _EDGE_BYTES = 16, 64 * 1024, 1024 * 1024


def cache_dir() -> Path:
    """The per-user cache root: ``$MLX_PROVIDERS_CACHE``, else the platform's cache dir."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-providers"
    if os.name == "nt":
        local = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(local) / "mlx-providers" / "Cache"
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "mlx-providers"


def on_accelerator() -> bool:
    """Whether mlx runs on Metal or CUDA here (a conversion then keeps float16 weights)."""
    from engine.device.loading.weights import accelerator_available

    return accelerator_available()


# --- the cache key ------------------------------------------------------------------------------


def gguf_fingerprint(path: str | os.PathLike[str]) -> str:
    """A content key for a (large) file: its size, first and last MiB and 16 spread samples.

    Hashing ~3 MB takes milliseconds where hashing a 98 MB GGUF in full takes ~0.1 s (and a
    4 GB one seconds) on every start. The header (first MiB) names the model and its tokenizer;
    the samples and tail catch files that differ only in tensor data.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        digest.update(f.read(_EDGE_BYTES))
        for i in range(_SAMPLE_COUNT):
            f.seek(size * i // _SAMPLE_COUNT)
            digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _EDGE_BYTES))
        digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:20]


def _cache_name(gguf_path: Path, fingerprint: str, quantized: bool, float_dtype: str) -> str:
    """Directory name: readable stem, content key, weight format and converter version."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem)[:80]
    variant = f"{'q' if quantized else 'dq'}-{float_dtype}"
    return f"{stem}-{fingerprint}-{variant}-v{CONVERTER_VERSION}"


# --- atomic publication -------------------------------------------------------------------------


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive advisory lock on ``lock_path``; yields whether locking is available.

    The lock file is never deleted (deleting it would let two holders lock different inodes).
    Where ``fcntl`` is missing, concurrency still ends well through rename-race tolerance.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)  # a cache root not made yet
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` is a published model directory (only a finished rename makes one)."""
    return path.is_dir() and (path / "config.json").is_file()


def _fsync_tree(root: Path) -> None:
    """Flush every file and the directory itself, so a rename never publishes unwritten data."""
    for child in root.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
    with contextlib.suppress(OSError):  # directories can't be opened for fsync everywhere
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_atomically(tmp: Path, final: Path) -> None:
    """Rename a fully written ``tmp`` to ``final``; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_model_dir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def converted_gguf_dir(gguf_path: str | os.PathLike[str], *, quantized: bool) -> Path:
    """The cached mlx-lm directory for a GGUF file, converting it first if needed.

    The cache key is the file's fingerprint plus the weight format, so a cache hit costs a
    few milliseconds. Raises ``UnsupportedModelError`` for files the converter can't map.
    """
    src = Path(gguf_path).expanduser().resolve()
    # float16 halves the non-quantized weights on a GPU; on the CPU MLX's float16 ops are
    # slow, and the activations follow the weights' dtype.
    float_dtype: FloatDtype = "float16" if quantized and on_accelerator() else "float32"
    name = _cache_name(src, gguf_fingerprint(src), quantized, float_dtype)
    root = cache_dir() / "models"
    final = root / name
    if is_model_dir(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{name}.lock") as locked:
        if is_model_dir(final):  # another process converted it while we waited
            return final
        if locked:  # no one else can be writing these: they are leftovers of a crash
            for stale in root.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            convert_gguf(src, tmp, quantized=quantized, float_dtype=float_dtype)
            _fsync_tree(tmp)
            publish_atomically(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
