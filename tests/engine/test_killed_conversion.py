"""A process SIGKILLed in the middle of converting a model leaves a cache the next start repairs.

The kill point is made deterministic by the converter's test seam
(``$MLX_PROVIDERS_TEST_PAUSE_CONVERSION_AFTER``): the child writes the weights and
``config.json`` (what makes a directory look like a model), says so, and blocks; the test
then kills it with SIGKILL, so no handler or ``finally`` of the child runs. Run on a tiny
GGUF always, and on the default model's GGUF when it is on this machine (converting it
takes ~4 s on 2 CPU cores).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.models.default_model import DEFAULT_MODEL_FILE, default_model_gguf_here
from engine.models.gguf import PAUSE_ENV_VAR
from engine.models.resolve import resolve_model
from engine.models.user_cache import CACHE_ENV_VAR
from tests.conftest import greedy, request_for

REPO_ROOT = Path(__file__).resolve().parents[2]
PAUSE_AFTER = "config.json"  # weights and config written, tokenizer not yet

_CONVERT = """
import sys
import engine.models.resolve as models
print(models.resolve_model(sys.argv[1] or None), flush=True)
"""


def _cache_with(root: Path, default_gguf: Path | None) -> Path:
    """An empty cache; for the default model, its GGUF where resolution finds it offline."""
    if default_gguf is not None:
        (root / "downloads").mkdir(parents=True)
        (root / "downloads" / DEFAULT_MODEL_FILE).symlink_to(default_gguf)
    return root


def _kill_mid_conversion(spec: str, cache: Path) -> None:
    """Convert ``spec`` in a child process, SIGKILL it once it has paused mid-conversion."""
    env = {**os.environ, CACHE_ENV_VAR: str(cache), PAUSE_ENV_VAR: PAUSE_AFTER,
           "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CONVERT, spec], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def read_stderr() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            lines.put(line)
        lines.put("")  # EOF: the child ended without pausing

    threading.Thread(target=read_stderr, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=180)
            seen.append(line)
            if not line or PAUSE_ENV_VAR in line:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert line, f"the child ended before pausing: {''.join(seen)[-2000:]}"
    assert child.returncode == -signal.SIGKILL


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("model", ["tiny-gguf", "default"])
def test_killed_conversion_leaves_a_cache_the_next_start_repairs(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if model == "default":
        default_gguf = default_model_gguf_here()
        if default_gguf is None:
            pytest.skip("the default model's GGUF is not on this machine (no download here)")
        spec = ""
    else:
        pytest.importorskip("gguf", reason="the gguf package (dev dependency) writes test files")
        from tests.engine.test_gguf import write_tiny_llama_gguf

        default_gguf = None
        spec = str(write_tiny_llama_gguf(tmp_path / "tiny.gguf", tensor_type="Q4_1"))
    cache = _cache_with(tmp_path / "cache", default_gguf)

    _kill_mid_conversion(spec, cache)
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []
    (half,) = models.glob(".*.tmp-*")  # the killed half model, hidden from every resolver
    assert {"config.json", "model.safetensors"} <= {p.name for p in half.iterdir()}
    assert not (half / "tokenizer.json").exists()

    # The next start: an engine on the same spec and cache converts again and publishes.
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    with Engine(spec or None, EngineConfig(max_batch=2)) as eng:
        result = eng.submit(request_for([5, 6, 7, 8], greedy(6))).result(timeout=120)
        assert len(result.token_ids) == 6
        repaired = eng.model_path
    assert repaired.parent == models and not list(models.glob(".*.tmp-*"))

    # Its files are byte for byte those of a clean conversion in a fresh cache.
    clean_cache = _cache_with(tmp_path / "clean", default_gguf)
    monkeypatch.setenv(CACHE_ENV_VAR, str(clean_cache))
    clean = resolve_model(spec or None)
    assert clean.name == repaired.name
    assert _files(repaired) == _files(clean)
