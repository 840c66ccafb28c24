"""Real tokenizers' and chat templates' source files, fetched once from PyPI and cached.

Two packages carry them: the llama-cpp-python sdist vendors llama.cpp's vocab-only GGUFs
(``models/ggml-vocab-*.gguf`` with ``.inp``/``.out`` tokenization vectors) and 70 published
chat templates (``models/templates/*.jinja``); the mistral-common wheel ships Mistral's
Tekken vocabularies (``tekken_*.json``). Each is fetched with ``pip download --no-deps``
(never installed), only the files needed are extracted, and the archive is deleted. The
result lives under the test cache (``$MLX_PROVIDERS_TEST_CACHE``, else the user cache),
published by rename under a lock, so parallel sessions fetch it once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from engine.models.user_cache import cache_dir, exclusive_lock

LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"
MISTRAL_COMMON_REQUIREMENT = "mistral-common==1.13.1"
_MODELS = "/vendor/llama.cpp/models/"


class AssetUnavailable(RuntimeError):
    """A package could not be fetched (offline, no pip): the message names which."""


def assets_root() -> Path:
    """Where fetched assets live: the test cache when set (CI keeps it), else the user's."""
    override = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    return (Path(override) if override else cache_dir()) / "family-assets"


def pip_download(requirement: str, dest: Path, *, sdist: bool) -> Path:
    """Download one distribution of ``requirement`` into ``dest``; its path."""
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *kind,
               "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            check=False, timeout=900)
    files = sorted(p for p in dest.iterdir() if p.suffix in (".gz", ".whl", ".zip"))
    if result.returncode != 0 or not files:
        tail = " ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise AssetUnavailable(f"`pip download --no-deps {requirement}` failed "
                               f"(exit {result.returncode}): {tail}")
    return files[0]


def _extract_llama_cpp(archive: Path, out: Path) -> None:
    """The vocab GGUFs with their vectors, and the chat templates, flattened into ``out``."""
    (out / "vocab").mkdir(parents=True)
    (out / "templates").mkdir()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.isfile() or _MODELS not in member.name:
                continue
            rest = member.name.split(_MODELS, 1)[1]
            name = Path(rest).name
            if "/" not in rest and name.startswith("ggml-vocab-"):
                target = out / "vocab" / name
            elif rest.startswith("templates/") and name.endswith(".jinja"):
                target = out / "templates" / name
            else:
                continue
            source = tar.extractfile(member)
            assert source is not None  # a regular file always has contents
            with source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)


def _extract_tekken(archive: Path, out: Path) -> None:
    """The wheel's ``tekken_*.json`` vocabularies into ``out``."""
    out.mkdir(parents=True)
    with zipfile.ZipFile(archive) as wheel:
        for name in wheel.namelist():
            if Path(name).name.startswith("tekken") and name.endswith(".json"):
                with wheel.open(name) as source, open(out / Path(name).name, "wb") as sink:
                    shutil.copyfileobj(source, sink)


def _fetched(name: str, requirement: str, *, sdist: bool,
             extract: Callable[[Path, Path], None]) -> Path:
    """``assets_root()/name``, fetched and extracted once (under a lock, by rename)."""
    root = assets_root()
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{name}.lock"):
        if final.is_dir():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            (work / "download").mkdir()
            archive = pip_download(requirement, work / "download", sdist=sdist)
            extract(archive, work / "out")
            os.rename(work / "out", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def llama_cpp_models() -> Path:
    """A directory with ``vocab/ggml-vocab-*.gguf(.inp|.out)`` and ``templates/*.jinja``."""
    return _fetched("llama-cpp-python-0.3.36", LLAMA_CPP_REQUIREMENT, sdist=True,
                    extract=_extract_llama_cpp)


def tekken_dir() -> Path:
    """A directory with mistral-common's ``tekken_*.json`` vocabularies."""
    return _fetched("mistral-common-1.13.1", MISTRAL_COMMON_REQUIREMENT, sdist=False,
                    extract=_extract_tekken)


def template(name: str) -> str:
    """A published chat template from the sdist, by file stem (``Qwen-Qwen3-0.6B``)."""
    return (llama_cpp_models() / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def vocab_file(name: str) -> Path:
    """A vocab-only GGUF from the sdist, by llama.cpp's name (``qwen2``, ``llama-bpe``)."""
    return llama_cpp_models() / "vocab" / f"ggml-vocab-{name}.gguf"


# tiktoken names its cache files by the SHA-1 of each encoding's download URL.
_TIKTOKEN_CACHE_NAMES = {
    "o200k": "fb374d419588a4632f3f557e76b4b70aebbca790",
    "cl100k": "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
}


def tiktoken_file(name: str) -> Path:
    """tiktoken's ``o200k_base`` / ``cl100k_base`` ranks from llama-index-core's tiktoken
    cache (a dependency of the project's llama-index extra)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_index.core")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "_static" / "tiktoken_cache" / _TIKTOKEN_CACHE_NAMES[name]
        if candidate.is_file():
            return candidate
    raise AssetUnavailable(f"{name}_base is not in llama-index-core's tiktoken cache "
                           "(install it: pip install -e '.[llama-index]')")


def o200k_file() -> Path:
    """o200k_base's ranks (gpt-oss's vocabulary before its harmony tokens)."""
    return tiktoken_file("o200k")


def cl100k_file() -> Path:
    """cl100k_base's ranks."""
    return tiktoken_file("cl100k")
