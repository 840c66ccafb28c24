"""Where a run says it requires them, the optional pieces are really there.

Tests that need the native CPU kernels or the family assets (llama-cpp-python's sdist,
mistral-common's wheel, fetched through pip) skip where those are missing, naming what is
missing: a laptop without a compiler, or offline, still runs the rest. CI sets the
switches below, so a kernel build that silently failed, or assets that could not be
fetched, turn its run red instead of skipping a third of the suite.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_NATIVE = "MLX_PROVIDERS_REQUIRE_NATIVE"
REQUIRE_ASSETS = "MLX_PROVIDERS_REQUIRE_FAMILY_ASSETS"


def _required(switch: str) -> bool:
    return os.environ.get(switch) == "1"


@pytest.mark.skipif(not _required(REQUIRE_NATIVE), reason=f"{REQUIRE_NATIVE} is not set")
def test_the_native_kernels_were_built_where_the_run_requires_them() -> None:
    from engine.device.kernels import cpu_kernels

    status = cpu_kernels.kernel_status()
    assert cpu_kernels.kernels_available(), (
        f"the CPU kernels did not build or load: {status.reason} (compiler: "
        f"{shutil.which('c++') or shutil.which('g++') or 'none'})")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux), or none known."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(not _required(REQUIRE_NATIVE), reason=f"{REQUIRE_NATIVE} is not set")
def test_each_instruction_set_the_cpu_has_was_built_with_its_flags() -> None:
    """An instruction-set unit that built without its flags leaves its table out and the
    CPU runs the next one down, silently but for a line in the build log: a checkout ran
    the AVX2 kernels on an AVX-512 CPU that way, at ~0.6x the speed."""
    from engine.device.kernels import cpu_kernels

    if os.environ.get("MLX_PROVIDERS_CPU_ISA"):
        pytest.skip("MLX_PROVIDERS_CPU_ISA caps the instruction set on purpose")
    flags = _cpu_flags()
    if not {"avx512f", "avx2"} & flags:
        pytest.skip("no x86 feature flags known here (/proc/cpuinfo)")
    status = cpu_kernels.kernel_status()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert status.isa == "avx512", status
        assert cpu_kernels.int8_path() == ("avx512-vnni" if "avx512_vnni" in flags else "")
    elif {"avx2", "fma", "f16c"} <= flags:
        assert status.isa == "avx2", status


@pytest.mark.skipif(not _required(REQUIRE_ASSETS), reason=f"{REQUIRE_ASSETS} is not set")
def test_the_family_assets_were_fetched_where_the_run_requires_them() -> None:
    from testkit.families import assets

    assert (assets.llama_cpp_models() / "templates").is_dir()  # raises AssetUnavailable
    assert assets.tekken_dir().is_dir()
