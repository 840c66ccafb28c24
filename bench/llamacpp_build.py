"""The CPU peer, built once: llama.cpp from the llama-cpp-python sdist's vendored source.

``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`` fetches the sdist
into a cache directory (``$MLX_PROVIDERS_CACHE/llamacpp``, never the repository), which is
unpacked and built with ``cmake -DGGML_NATIVE=ON`` (the flags a Linux user building it for
this machine would pick) less AMX, only the two tools the bench runs. AMX is left out: the
engine's kernels do not use it either, and on virtual machines that report AMX without
enabling its registers, ggml's AMX matmul dies of SIGILL at the first product. On 2 cores
the build takes ~15 minutes, under ``nice`` so that it yields to other work; later runs
reuse it.

    python bench/llamacpp_build.py        # prints the bin directory
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from engine.models.user_cache import cache_dir

LLAMA_CPP_PYTHON = "0.3.36"
TOOLS = ("llama-batched-bench", "llama-server")


def build_root() -> Path:
    """Where the sdist, the unpacked source and the build live (outside the repository)."""
    return cache_dir() / "llamacpp" / LLAMA_CPP_PYTHON


def _source_dir(root: Path) -> Path:
    """The vendored llama.cpp source, downloading and unpacking the sdist the first time."""
    source = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--dest", str(root),
                        "--disable-pip-version-check"], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    # Unpack beside, then rename: an interrupted unpack never looks like a finished one.
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    with tarfile.open(sdists[0]) as archive:
        archive.extractall(work, filter="data")
    os.replace(work / source.relative_to(root).parts[0], root / source.relative_to(root).parts[0])
    shutil.rmtree(work, ignore_errors=True)
    return source


def _x86() -> bool:
    return os.uname().machine in ("x86_64", "AMD64")


def llamacpp_bin(jobs: int = 2) -> Path:
    """The directory holding ``llama-batched-bench`` and ``llama-server``, built if missing."""
    root = build_root()
    build = root / "build"
    bin_dir = build / "bin"
    stamp = build / "mlx-providers-flags"  # a build from before AMX was left out is redone
    if stamp.is_file() and all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    source = _source_dir(root)
    print(f"building llama.cpp {LLAMA_CPP_PYTHON} (sdist's vendor/) in {build}: ~15 min on "
          "2 cores, once", file=sys.stderr, flush=True)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if _x86() else ""
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build), "--config", "Release", "-j",
                    str(jobs), "--target", *TOOLS], check=True)
    stamp.write_text(no_amx + "\n")
    return bin_dir


if __name__ == "__main__":
    print(llamacpp_bin())
