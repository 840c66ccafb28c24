"""Load an optimized BLAS before ``mlx.core`` so libmlx's cblas calls use it (Linux only).

The Linux ``mlx-cpu`` wheel links libmlx against the netlib reference BLAS (~3 GFLOP/s).
libmlx binds ``cblas_sgemm`` & co. through the dynamic loader's global scope first, so a
library loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is imported wins: in-process, no
``LD_PRELOAD``. float32 matmuls then run ~20x faster.

Candidates, best first:

1. ``scipy-openblas32`` (PyPI, 8 MB wheel, no system libraries, DYNAMIC_ARCH). It prefixes
   every symbol with ``scipy_``; a copy renamed in memory exports the plain names.
2. A system OpenBLAS (e.g. Debian ``libopenblas0-pthread``).
3. MKL from the ``mkl`` wheel, if the user installed it (280 MB; its generic kernels on AMD).

``cmeel-openblas`` is deliberately not a candidate: its 0.3.31 wheel is built for SKYLAKEX
only (SIGILL on CPUs without AVX-512) and needs the system's ``libgfortran.so.5``.

``MLX_PROVIDERS_FAST_BLAS``: ``0``/``off``/``false`` keeps the reference BLAS; a path to a
shared library loads that library instead of searching. Threads: ``OPENBLAS_NUM_THREADS``
(or ``OMP_NUM_THREADS``) if set, else all CPUs but one (see ``_default_threads``).

This module imports nothing from mlx, and from ``engine`` only the pure ``elf_symbols``:
``engine/__init__.py`` calls :func:`activate_fast_blas` before anything imports mlx.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import importlib.metadata
import importlib.util
import os
import struct
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine._platform.elf_symbols import got_offset, strip_symbol_prefix

__all__ = [
    "ENV_VAR",
    "BlasInfo",
    "MlxBinding",
    "activate_fast_blas",
    "blas_info",
    "mlx_blas_binding",
]

ENV_VAR = "MLX_PROVIDERS_FAST_BLAS"
_OFF_VALUES = frozenset({"0", "off", "false", "no"})
# OpenBLAS reads these itself when it loads; a user's choice wins over our default.
_THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
# What libmlx 0.32 imports from BLAS (`nm -D --undefined-only libmlx.so`).
_CBLAS_SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
_REFERENCE = "reference"


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS float32 matmuls in mlx run on, and why."""

    name: str
    path: str | None
    active: bool
    reason: str
    threads: int | None = None


@dataclass(frozen=True)
class MlxBinding:
    """Where libmlx's imported BLAS function really points, read from libmlx's GOT."""

    symbol: str
    address: int
    library: str
    reference: bool


class _Unavailable(Exception):
    """A candidate cannot be used here; the message says what is missing."""


_lock = threading.Lock()
_info: BlasInfo | None = None
_loaded_base: int | None = None  # dli_fbase of the library we loaded, to recognise it
_verified: BlasInfo | None = None


def activate_fast_blas() -> BlasInfo:
    """Load the best available BLAS into the global symbol scope; idempotent, thread-safe."""
    global _info
    with _lock:
        if _info is None:
            _info = _activate()
        return _info


def blas_info() -> BlasInfo:
    """The BLAS in use; once mlx.core is loaded, checked against libmlx's real binding."""
    global _verified
    with _lock:
        info = _info or BlasInfo(_REFERENCE, None, False, "activate_fast_blas() has not run")
        if _verified is not None or "mlx.core" not in sys.modules or not _is_linux():
            return _verified or info
        binding = mlx_blas_binding()
        if binding is None:
            return info
        if binding.reference:
            checked = BlasInfo(
                _REFERENCE,
                binding.library,
                False,
                f"libmlx's {binding.symbol} is bound to the reference BLAS; " + info.reason,
                info.threads,
            )
        elif _loaded_base is not None and _fbase(binding.address) == _loaded_base:
            checked = info
        else:
            checked = BlasInfo(
                Path(binding.library).name,
                binding.library,
                True,
                f"libmlx's {binding.symbol} is bound to {binding.library} "
                "(loaded by someone else, e.g. LD_PRELOAD)",
                None,
            )
        _verified = checked
        return checked


def _is_linux() -> bool:
    return sys.platform.startswith("linux")


def _activate() -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo(
            "accelerate", None, True, "macOS: mlx uses Metal and Accelerate, which are already fast"
        )
    if not _is_linux():
        return BlasInfo(
            "platform default",
            None,
            False,
            f"fast BLAS loading is implemented for Linux only, not {sys.platform}",
        )
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting.lower() in _OFF_VALUES:
        return BlasInfo(_REFERENCE, None, False, f"disabled by {ENV_VAR}={setting}")
    if "mlx.core" in sys.modules:
        return _too_late()
    candidates: list[tuple[str, Callable[[], BlasInfo]]]
    if "/" in setting:
        custom = Path(setting)
        candidates = [("custom", functools.partial(_load_file, custom, f"custom ({custom.name})"))]
    else:
        candidates = [
            ("scipy-openblas32", _load_scipy_openblas32),
            ("system OpenBLAS", _load_system_openblas),
            ("mkl", _load_mkl),
        ]
    missing: list[str] = []
    for label, load in candidates:
        try:
            return load()
        except _Unavailable as exc:
            missing.append(f"{label}: {exc}")
    return BlasInfo(
        _REFERENCE,
        None,
        False,
        "no optimized BLAS could be loaded (" + "; ".join(missing) + "); "
        "`pip install scipy-openblas32` fixes it",
    )


def _too_late() -> BlasInfo:
    """mlx.core is already bound: report what it is bound to, warn once if that is slow."""
    binding = mlx_blas_binding()
    if binding is not None and not binding.reference:
        return BlasInfo(
            Path(binding.library).name,
            binding.library,
            True,
            f"mlx.core was imported first; its {binding.symbol} is already bound "
            f"to {binding.library}",
        )
    fix = (
        f"import engine (or engine._platform.blas) before mlx, or set {ENV_VAR}=0 "
        "to keep the reference BLAS without this warning"
    )
    # activate_fast_blas caches its result, so this warns once per process.
    warnings.warn(
        f"mlx.core was imported before the fast BLAS could be loaded; float32 "
        f"matmuls stay on the ~20x slower reference BLAS. Fix: {fix}",
        RuntimeWarning,
        stacklevel=4,
    )
    return BlasInfo(
        _REFERENCE,
        binding.library if binding else None,
        False,
        f"mlx.core was imported before activate_fast_blas(); {fix}",
    )


# ---------------------------------------------------------------------------- candidates


def _load_scipy_openblas32() -> BlasInfo:
    # find_spec does not import the package: nothing of it is needed but the file.
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or spec.origin is None:
        raise _Unavailable("the PyPI package scipy-openblas32 is not installed")
    files = sorted((Path(spec.origin).parent / "lib").glob("libscipy_openblas*.so*"))
    if not files:
        raise _Unavailable(f"no libscipy_openblas*.so in {Path(spec.origin).parent / 'lib'}")
    data = bytearray(files[0].read_bytes())
    try:
        renamed = strip_symbol_prefix(data, b"scipy_")
    except (ValueError, IndexError, struct.error) as exc:
        raise _Unavailable(f"cannot rename the symbols of {files[0]}: {exc}") from exc
    for sibling in sorted(files[0].parent.glob("lib*.so*")):
        if not sibling.name.startswith("libscipy_openblas"):
            # The aarch64 wheel ships libgfortran-<hash>.so beside it, found via
            # RPATH=$ORIGIN; a memfd has no $ORIGIN, but a NEEDED entry also matches a
            # library already loaded under that soname. RTLD_LOCAL: no symbols leak.
            try:
                ctypes.CDLL(str(sibling), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            except OSError as exc:
                raise _Unavailable(f"cannot load {sibling}: {exc}") from exc
    lib = _load_bytes(data, files[0])
    # The dist-info folder's name: importlib.metadata would parse 60 ms of license text.
    infos = sorted(Path(spec.origin).parents[1].glob("scipy_openblas32-*.dist-info"))
    version = infos[-1].name.removesuffix(".dist-info").split("-", 1)[1] if infos else "?"
    return _describe(
        lib,
        f"openblas (scipy-openblas32 {version})",
        files[0],
        f"symbols renamed scipy_* -> * ({renamed}) in an in-memory copy",
    )


def _load_system_openblas() -> BlasInfo:
    for path in _system_openblas_paths():
        with contextlib.suppress(_Unavailable):
            return _load_file(path, f"openblas (system, {path.name})")
    raise _Unavailable("no libopenblas.so.0 found (Debian/Ubuntu: apt install libopenblas0)")


def _system_openblas_paths() -> list[Path]:
    found = ctypes.util.find_library("openblas")  # consults ldconfig's cache
    names = [found] if found else []
    patterns = [
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
        "/usr/local/lib/libopenblas.so.0",
    ]
    paths = [Path(p) for pattern in patterns for p in sorted(glob.glob(pattern))]
    # find_library returns a bare soname; dlopen resolves it through the same cache.
    return [Path(n) for n in names] + paths


def _load_mkl() -> BlasInfo:
    libdirs = {
        Path(sysconfig.get_config_var("prefix") or sys.prefix) / "lib",
        Path(sys.prefix) / "lib",
    }
    for libdir in sorted(libdirs):
        mkl = next(iter(sorted(libdir.glob("libmkl_rt.so*"))), None)
        if mkl is None:
            continue
        omp = libdir / "libiomp5.so"
        with contextlib.suppress(OSError):
            # mkl_rt picks its threading layer at the first call; libiomp5 must be global.
            ctypes.CDLL(str(omp), mode=os.RTLD_GLOBAL)
        lib = _load_global(str(mkl), mkl, probe=False)
        # 0 = MKL_THREADING_INTEL (needs libiomp5), 1 = MKL_THREADING_SEQUENTIAL.
        lib.MKL_Set_Threading_Layer(ctypes.c_int(0 if omp.exists() else 1))
        if not _user_chose_threads("MKL_NUM_THREADS"):
            lib.MKL_Set_Num_Threads(ctypes.c_int(_default_threads()))
        _check_sgemm(lib, mkl)
        version = _version("mkl")
        threads = int(lib.MKL_Get_Max_Threads())
        return BlasInfo(
            f"mkl ({version})",
            str(mkl),
            True,
            f"loaded {mkl} with RTLD_GLOBAL before mlx.core",
            threads,
        )
    raise _Unavailable("the PyPI package mkl is not installed")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # files present without metadata
        return "unknown version"


def _load_file(path: Path, name: str) -> BlasInfo:
    lib = _load_global(str(path), path)
    # A bare soname (from ldconfig) is reported as the file the loader picked.
    info = _dladdr(_symbol_address(lib, "cblas_sgemm"))
    resolved = Path(info.dli_fname.decode()) if info is not None and info.dli_fname else path
    return _describe(lib, name, resolved, "")


# ------------------------------------------------------------------------------- loading


def _load_global(load_as: str, path: Path, probe: bool = True) -> ctypes.CDLL:
    """dlopen locally, check it exports what libmlx needs, then promote it to global."""
    global _loaded_base
    try:
        lib = ctypes.CDLL(load_as, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as exc:
        raise _Unavailable(f"cannot load {path}: {exc}") from exc
    absent = [s for s in _CBLAS_SYMBOLS if not hasattr(lib, s)]
    if absent:
        raise _Unavailable(f"{path} does not export {', '.join(absent)}")
    if probe:
        _check_sgemm(lib, path)
    # A second dlopen with RTLD_NOLOAD promotes the same object to the global scope
    # (dlopen(3)); checking first keeps a broken library out of it.
    ctypes.CDLL(load_as, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD | os.RTLD_NOW)
    _loaded_base = _fbase(_symbol_address(lib, "cblas_sgemm"))
    return lib


def _load_bytes(data: bytearray, path: Path) -> ctypes.CDLL:
    """dlopen an in-memory image: from a memfd, else from an unlinked temp file."""
    failure = _Unavailable(f"cannot create a file to load {path} from")
    for use_memfd in (True, False):
        try:
            load_as = _write_image(data, path.name, use_memfd)
        except OSError:
            continue
        try:
            return _load_global(load_as, path)
        except _Unavailable as exc:
            # Kernels with vm.memfd_noexec=2 refuse to map a memfd executable.
            failure = exc
        finally:
            # Once mapped, the loader needs neither the fd nor the file.
            if use_memfd:
                os.close(int(load_as.rsplit("/", 1)[1]))
            else:
                os.unlink(load_as)
    raise failure


def _write_image(data: bytearray, name: str, use_memfd: bool) -> str:
    if use_memfd:
        if not hasattr(os, "memfd_create"):
            raise OSError("no memfd_create")
        fd = os.memfd_create(f"mlx-providers:{name}")
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(data)  # a buffered write loops until every byte is written
        return f"/proc/self/fd/{fd}"
    handle, path = tempfile.mkstemp(prefix="mlx-providers-", suffix=f"-{name}")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    return path


def _describe(lib: ctypes.CDLL, name: str, path: Path, note: str) -> BlasInfo:
    threads = _set_threads(lib)
    config = ""
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = "; " + bytes(lib.openblas_get_config()).decode(errors="replace")
    extra = f"; {note}" if note else ""
    return BlasInfo(
        name,
        str(path),
        True,
        f"loaded {path} with RTLD_GLOBAL before mlx.core{extra}{config}",
        threads,
    )


def _default_threads() -> int:
    """All CPUs we may run on but one, at least one.

    OpenBLAS workers busy-wait for work; when one is descheduled, a small decode GEMM
    waits out a time slice. The engine's callers (event loop, tokenizer) and other
    processes need a core, so one is left free. Measured on 2 shared cores
    (bench/blas.py, 16-row decode of a float32 26M model, 5 runs each): 1 thread gave
    206-349 tok/s, 2 threads 29-426 tok/s. Set OPENBLAS_NUM_THREADS on a dedicated box.
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _user_chose_threads(*names: str) -> bool:
    return any(os.environ.get(v) for v in (*names, *_THREAD_ENV_VARS))


def _set_threads(lib: ctypes.CDLL) -> int | None:
    """Apply the default thread count unless the user set one; return the count in use."""
    if not hasattr(lib, "openblas_get_num_threads"):
        return None
    if not _user_chose_threads():
        lib.openblas_set_num_threads(ctypes.c_int(_default_threads()))
    return int(lib.openblas_get_num_threads())


def _check_sgemm(lib: ctypes.CDLL, path: Path) -> None:
    """Run a 2x2 sgemm: a renamed or foreign library must really compute."""
    floats = ctypes.c_float * 4
    a, b, c = floats(1, 2, 3, 4), floats(5, 6, 7, 8), floats(0, 0, 0, 0)
    row_major, no_trans = 101, 111  # CblasRowMajor, CblasNoTrans
    lib.cblas_sgemm(
        row_major,
        no_trans,
        no_trans,
        2,
        2,
        2,
        ctypes.c_float(1.0),
        a,
        2,
        b,
        2,
        ctypes.c_float(0.0),
        c,
        2,
    )
    if list(c) != [19.0, 22.0, 43.0, 50.0]:
        raise _Unavailable(f"{path}: cblas_sgemm computed {list(c)}, not [19, 22, 43, 50]")


# ------------------------------------------------------------------ checking the binding


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _libdl() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    # glibc >= 2.34 has dladdr in libc itself; older ones keep it in libdl.
    return libc if hasattr(libc, "dladdr") else ctypes.CDLL("libdl.so.2")


def _dladdr(address: int) -> _DlInfo | None:
    info = _DlInfo()
    ok = _libdl().dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    return info if ok else None


def _fbase(address: int) -> int | None:
    info = _dladdr(address)
    return info.dli_fbase if info is not None else None


def _symbol_address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


def mlx_blas_binding(symbol: str = "cblas_sgemm") -> MlxBinding | None:
    """Read libmlx's GOT slot for ``symbol``: the function mlx really calls.

    None when libmlx is not loaded (or not on Linux). Python loads extensions with
    RTLD_NOW, so the slot holds the final address, not a lazy PLT stub.
    """
    try:
        return _read_binding(symbol)
    except (OSError, ValueError, IndexError, struct.error):
        return None  # no /proc, an unexpected libmlx layout: unknown, not an error


def _read_binding(symbol: str) -> MlxBinding | None:
    libmlx = _mapped_file("libmlx.so")
    if libmlx is None:
        return None
    slot = got_offset(libmlx, symbol)
    handle = ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_NOW)._handle
    link_map = ctypes.c_void_p()
    rtld_di_linkmap = 2
    if _libdl().dlinfo(ctypes.c_void_p(handle), rtld_di_linkmap, ctypes.byref(link_map)) != 0:
        return None
    load_bias = ctypes.c_size_t.from_address(link_map.value or 0).value  # link_map.l_addr
    target = ctypes.c_void_p.from_address(load_bias + slot).value or 0
    info = _dladdr(target)
    library = (info.dli_fname or b"?").decode() if info is not None else "?"
    # The mapping name is truer than dli_fname for a memfd ("/memfd:... (deleted)").
    library = _mapping_of(target) or library
    reference = "/mlx_cpu.libs/libblas" in library or Path(library).name.startswith("libblas-")
    return MlxBinding(symbol, target, library, reference)


def _mapped_file(basename_prefix: str) -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and Path(parts[5].strip()).name.startswith(basename_prefix):
                return parts[5].strip()
    return None


def _mapping_of(address: int) -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[5].strip() if len(parts) == 6 else None
    return None


# ------------------------------------------------------------------------- ELF surgery
# Just enough of ELF64 little-endian (every mlx Linux wheel: x86_64, aarch64) to rename
# dynamic symbols and to read relocations. Tags and layouts: the System V gABI.
