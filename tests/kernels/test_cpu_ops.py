"""The CPU kernels as ops: against MLX's own ops on random shapes, and bit-exact where the
engine needs it (a row's result never depends on the rows beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.device.kernels import cpu_kernels
from testkit import kernel_checks

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernels_available(),
    reason=f"CPU kernels unavailable here: {cpu_kernels.kernel_status().reason}")


@pytest.mark.parametrize("check", kernel_checks.ALL, ids=lambda c: c.__name__)
def test_kernel_check(check: Callable[[], None]) -> None:
    check()


def test_status_names_the_instruction_set_and_threads() -> None:
    status = cpu_kernels.kernel_status()
    assert status.isa in ("avx512", "avx2", "neon", "generic")
    assert status.threads >= 1
    assert status.describe() == f"{status.isa}, {status.threads} threads"


def _lower_sets() -> list[str]:
    """The instruction sets below the one chosen here (this CPU runs them too)."""
    ladder = ["avx512", "avx2", "generic"] if cpu_kernels.kernel_status().isa in (
        "avx512", "avx2") else ["neon", "generic"]
    isa = cpu_kernels.kernel_status().isa
    return ladder[ladder.index(isa) + 1:] if isa in ladder else []


@pytest.mark.parametrize("isa", _lower_sets() or ["none"])
def test_the_lower_instruction_sets_pass_the_same_checks(isa: str) -> None:
    """Each unit a CPU without this one's extensions would run, checked on this CPU."""
    if isa == "none":
        pytest.skip("no lower instruction set here")
    env = {**os.environ, "MLX_PROVIDERS_CPU_ISA": isa, "MLX_PROVIDERS_CPU_THREADS": "2"}
    run = subprocess.run([sys.executable, "-m", "testkit.kernel_checks"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == isa


def test_one_thread_gives_the_same_bits() -> None:
    """The thread split only partitions columns: one thread computes the same values."""
    env = {**os.environ, "MLX_PROVIDERS_CPU_THREADS": "1"}
    code = ("import engine, mlx.core as mx, numpy as np\n"
            "from engine.device.kernels import cpu_kernels as k\n"
            "from testkit.kernel_checks import quantized_weights\n"
            "rng = np.random.default_rng(9)\n"
            "w, s, b = quantized_weights(rng, 300, 256, 4, 32, mx.float32)\n"
            "x = mx.array(rng.standard_normal((20, 256)).astype(np.float32))\n"
            "print(np.array(k.quantized_matmul(x, w, s, b, 32, 4)).tobytes().hex())\n")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True,
                           text=True, timeout=300) for e in (env, dict(os.environ))]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout.splitlines()[-1] == runs[1].stdout.splitlines()[-1]


def test_the_extension_finds_libmlx_on_its_own() -> None:
    """Its RUNPATH names mlx's library directory: it loads in a process that has not
    imported ``mlx.core`` first (with only ``$ORIGIN`` it failed: libmlx.so not found)."""
    from engine.device.kernels import cpu_native

    code = "\n".join([
        "import importlib.util as u, sys",
        "spec = u.spec_from_file_location('engine.device.kernels.cpu_native', "
        f"{cpu_native.__file__!r})",
        "spec.loader.exec_module(u.module_from_spec(spec))",
        "assert 'mlx.core' not in sys.modules"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
