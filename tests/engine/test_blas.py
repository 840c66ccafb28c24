"""engine/_platform/blas.py: the fast BLAS really binds into libmlx and changes no result.

mlx.core binds its BLAS once per process, so every check runs in a fresh subprocess that
loads engine/_platform/blas.py by file path (module ``engine_blas``): no engine/__init__ needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"
BLAS_PY = ENGINE_DIR / "_platform" / "blas.py"
ENV_VAR = "MLX_PROVIDERS_FAST_BLAS"

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fast BLAS is Linux-only"),
    pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed"),
]

PRELUDE = f"""
import importlib.util, json, sys, types
# An empty 'engine' package: blas.py's sibling imports resolve, engine/__init__ never runs.
package = types.ModuleType("engine")
package.__path__ = [{str(ENGINE_DIR)!r}]
sys.modules["engine"] = package
spec = importlib.util.spec_from_file_location("engine_blas", {str(BLAS_PY)!r})
blas = importlib.util.module_from_spec(spec)
sys.modules["engine_blas"] = blas
spec.loader.exec_module(blas)

def mapping_of(address):
    # Read independently of engine_blas: which file is mapped at this address?
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5].strip() if len(parts) == 6 else ""
    return None

def report(**extra):
    info = blas.blas_info()
    binding = blas.mlx_blas_binding()
    out = dict(name=info.name, path=info.path, active=info.active, reason=info.reason,
               threads=info.threads, bound=None, mapping=None, reference=None, **extra)
    if binding is not None:
        out.update(bound=binding.library, reference=binding.reference,
                   mapping=mapping_of(binding.address))
    print("RESULT " + json.dumps(out))
"""


def run(code: str, fast: str | None = None) -> dict[str, Any]:
    """Run PRELUDE + code in a fresh interpreter; ``fast`` is the env var's value."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if fast is not None:
        env[ENV_VAR] = fast
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout + out.stderr
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    result["stderr"] = out.stderr
    return result


@cache
def fast_side() -> dict[str, Any]:
    """Activation from 8 threads at once, then mlx: the fast library's own report."""
    return run("""
import threading
infos = []
threads = [threading.Thread(target=lambda: infos.append(blas.activate_fast_blas()))
           for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
import mlx.core as mx
report(same_object=all(i is infos[0] for i in infos), calls=len(infos))
""")


def require_fast_library() -> dict[str, Any]:
    result = fast_side()
    if not result["active"]:
        # The reason lists every candidate and what it lacked, e.g. scipy-openblas32.
        pytest.skip(f"no fast BLAS here: {result['reason']}")
    return result


def test_fast_blas_is_what_libmlx_calls() -> None:
    result = require_fast_library()
    assert result["same_object"] and result["calls"] == 8  # idempotent under a race
    assert result["name"] != "reference" and result["path"]
    # libmlx's GOT slot for cblas_sgemm points outside the reference libblas ...
    assert result["reference"] is False
    mapping = result["mapping"]
    assert mapping and "mlx_cpu.libs" not in mapping and "libblas-" not in mapping
    # ... into the library we loaded: a memfd copy of it, or the file itself.
    assert "openblas" in mapping.lower() or mapping == result["path"], mapping
    assert result["threads"] is None or result["threads"] >= 1


MATMUL = """
blas.activate_fast_blas()
import numpy as np
import mlx.core as mx
rng = np.random.default_rng(0)
a = rng.standard_normal((48, 300), dtype=np.float32)
b = rng.standard_normal((300, 200), dtype=np.float32)
# Plain, transposed-operand and batched products: different cblas_sgemm flags.
out = mx.concatenate(
    [
        mx.array(a) @ mx.array(b),
        (mx.array(b).T @ mx.array(a).T).T,
        (mx.array(a)[None] @ mx.array(b)[None])[0],
    ],
    axis=0,
)
np.save(OUT, np.array(out))
report()
"""


def test_fast_and_reference_results_match(tmp_path: Path) -> None:
    require_fast_library()
    fast = run(f"OUT = {str(tmp_path / 'fast.npy')!r}\n" + MATMUL)
    ref = run(f"OUT = {str(tmp_path / 'ref.npy')!r}\n" + MATMUL, fast="0")
    assert fast["active"] and not fast["reference"]
    assert not ref["active"] and ref["reference"]  # the two sides really differ
    got, want = np.load(tmp_path / "fast.npy"), np.load(tmp_path / "ref.npy")
    assert got.shape == want.shape == (144, 200)
    # Summation order differs between the BLASes; entries near 0 need a small atol.
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", ["0", "off", "FALSE"])
def test_env_var_off_keeps_reference(value: str) -> None:
    result = run("blas.activate_fast_blas()\nimport mlx.core\nreport()", fast=value)
    assert result["name"] == "reference" and not result["active"]
    assert ENV_VAR in result["reason"]
    assert result["reference"] is True  # libmlx really calls the bundled netlib BLAS
    assert "RuntimeWarning" not in result["stderr"]


def test_mlx_imported_first_warns_once_and_is_not_active() -> None:
    result = run("""
import warnings
import mlx.core
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = blas.activate_fast_blas()
    second = blas.activate_fast_blas()
report(warnings=[str(w.message) for w in caught if w.category is RuntimeWarning],
       same=first is second)
""")
    assert len(result["warnings"]) == 1 and result["same"]
    assert "import engine" in result["warnings"][0] and ENV_VAR in result["warnings"][0]
    assert not result["active"] and result["name"] == "reference"
    assert result["reference"] is True


def test_missing_custom_library_falls_back_with_its_path() -> None:
    result = run("blas.activate_fast_blas()\nreport()", fast="/nonexistent/libblas_x.so")
    assert not result["active"] and result["name"] == "reference"
    assert "/nonexistent/libblas_x.so" in result["reason"]


def test_module_imports_no_mlx() -> None:
    result = run("report(mlx_loaded='mlx.core' in sys.modules or 'mlx' in sys.modules)", fast="0")
    assert result["mlx_loaded"] is False
