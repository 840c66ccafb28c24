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
    from engine.device import cpu_kernels

    status = cpu_kernels.kernel_status()
    assert cpu_kernels.kernels_available(), (
        f"the CPU kernels did not build or load: {status.reason} (compiler: "
        f"{shutil.which('c++') or shutil.which('g++') or 'none'})")


@pytest.mark.skipif(not _required(REQUIRE_ASSETS), reason=f"{REQUIRE_ASSETS} is not set")
def test_the_family_assets_were_fetched_where_the_run_requires_them() -> None:
    from testkit.families import assets

    assert (assets.llama_cpp_models() / "templates").is_dir()  # raises AssetUnavailable
    assert assets.tekken_dir().is_dir()
