"""Builds the optional CPU kernels (``engine.device.kernels.cpu_native``) at install time.

Everything else about the package is in pyproject.toml. The extension is C++ against the
installed ``mlx`` wheel (its headers and ``libmlx``) through nanobind, in MLX's binding
domain. Each instruction set's unit is compiled with its own flags and chosen at run time,
so one build runs on any CPU of its architecture. Where it cannot be built (no compiler, an
unknown platform, headers missing) the install still succeeds without it, and the engine
runs MLX's own CPU ops: ``Engine.stats().cpu_kernels`` says which.

``MLX_PROVIDERS_NO_NATIVE=1`` skips the build.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("native")
SOURCES = ["ops.cpp", "threads.cpp", "dispatch.cpp", "isa_generic.cpp", "isa_avx2.cpp",
           "isa_avx512.cpp", "isa_avx512_vnni.cpp", "isa_neon.cpp"]
MACHINE = platform.machine().lower()
X86 = MACHINE in ("x86_64", "amd64")
ARM64 = MACHINE in ("arm64", "aarch64")  # NEON is baseline there: no flags

# Flags per unit; a unit whose flags the compiler refuses is built without them (it then
# compiles to an empty table and the dispatcher skips it).
AVX512_FLAGS = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                 "-mf16c"] if X86 else [])
ISA_FLAGS: dict[str, list[str]] = {
    "ops.cpp": ["-ffp-contract=off"],  # RoPE keeps mx.fast.rope's separate products
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"] if X86 else [],
    "isa_avx512.cpp": AVX512_FLAGS,
    "isa_avx512_vnni.cpp": [*AVX512_FLAGS, "-mavx512vnni"] if X86 else [],
}
COMMON_FLAGS = ["-std=c++20", "-O3", "-fvisibility=hidden", "-fno-strict-aliasing",
                "-Wno-unused-function"]


class OptionalNativeBuild(build_ext):
    """Compiles per-unit flags, links against libmlx; on any failure, warns and goes on."""

    def build_extension(self, ext: Extension) -> None:
        if os.environ.get("MLX_PROVIDERS_NO_NATIVE") == "1":
            self._skip(ext, "MLX_PROVIDERS_NO_NATIVE=1")
            return
        if not (X86 or ARM64) or sys.platform not in ("linux", "darwin"):
            self._skip(ext, f"no kernels for {sys.platform}/{MACHINE}")
            return
        try:
            self._build(ext)
        except Exception as exc:  # a missing compiler or header must not fail the install
            self._skip(ext, f"{type(exc).__name__}: {exc}")

    def _skip(self, ext: Extension, why: str) -> None:
        print(f"mlx-providers: CPU kernels not built ({why}); MLX's own CPU ops will run",
              file=sys.stderr)
        target = Path(self.get_ext_fullpath(ext.name))
        if target.exists():
            target.unlink()  # a stale build must not outlive a skipped one

    def _build(self, ext: Extension) -> None:
        import mlx
        import nanobind

        mlx_root = Path(mlx.__path__[0])
        nb_root = Path(nanobind.__file__).parent
        includes = [str(NATIVE), str(mlx_root / "include"), str(nb_root / "include"),
                    str(nb_root / "ext" / "robin_map" / "include"),
                    sysconfig.get_paths()["include"]]
        if not (mlx_root / "include" / "mlx" / "array.h").is_file():
            raise FileNotFoundError(f"no mlx headers under {mlx_root}")
        lib_dirs = [str(mlx_root / "lib")]
        macros = [("NB_DOMAIN", "mlx"), ("NDEBUG", None)]
        build_temp = Path(self.build_temp) / "mlx_providers_native"
        build_temp.mkdir(parents=True, exist_ok=True)
        units = [(str(NATIVE / name), ISA_FLAGS.get(name, [])) for name in SOURCES]
        units.append((str(nb_root / "src" / "nb_combined.cpp"), ["-Os"]))

        def compile_unit(unit: tuple[str, list[str]]) -> list[str]:
            source, flags = unit
            try:
                return self.compiler.compile([source], output_dir=str(build_temp),
                                             macros=macros, include_dirs=includes,
                                             extra_postargs=COMMON_FLAGS + flags)
            except Exception as exc:
                if not flags:
                    raise
                # This unit then builds without its instruction set: its table is absent and
                # the CPU runs the next one down (stats().cpu_kernels names the one in use).
                print(f"mlx-providers: {source} did not build with {' '.join(flags)} "
                      f"({type(exc).__name__}); building it without them", file=sys.stderr)
                return self.compiler.compile([source], output_dir=str(build_temp),
                                             macros=macros, include_dirs=includes,
                                             extra_postargs=COMMON_FLAGS)

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            objects = [obj for objs in pool.map(compile_unit, units) for obj in objs]
        link_args = [f"-Wl,-rpath,{path}" for path in _mlx_runpaths(mlx_root)]
        if sys.platform == "darwin":
            link_args += ["-undefined", "dynamic_lookup"]
        self.compiler.link_shared_object(
            objects, self.get_ext_fullpath(ext.name), libraries=["mlx"],
            library_dirs=lib_dirs, extra_postargs=link_args, target_lang="c++")

    def get_outputs(self) -> list[str]:
        # A skipped build has no file to copy into place (editable installs copy outputs).
        return [out for out in super().get_outputs() if Path(out).exists()]


def _mlx_runpaths(mlx_root: Path) -> list[str]:
    """Where the loader finds libmlx: beside the installed package (site-packages/engine/
    device/kernels -> site-packages/mlx/lib); for an editable install, whose extension sits in the
    checkout, the installing environment's mlx (pip builds in an isolated environment whose
    own mlx is deleted afterwards, but with the target's interpreter, so its site-packages
    is the one the package runs from), then the mlx the build saw. The extension then loads
    on its own, not only because ``mlx.core`` was imported first."""
    origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    target = Path(sysconfig.get_paths()["platlib"]) / "mlx" / "lib"
    paths = [f"{origin}/../../../mlx/lib", str(target), str(mlx_root / "lib")]
    return list(dict.fromkeys(paths))


setup(
    ext_modules=[Extension("engine.device.kernels.cpu_native", sources=[], optional=True)],
    cmdclass={"build_ext": OptionalNativeBuild},
)
