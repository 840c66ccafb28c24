"""``make bench`` runs: the Makefile's bench scripts, small, on the tiny model.

The bench scripts are not imported by anything else, so a move or an API change broke them
silently before (``bench/blas.py`` loaded a file that had moved). This runs the target as a
user would, in this interpreter's environment, with sizes that take seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed here")
def test_make_bench_runs_and_prints_its_tables(tiny_model_dir: Path) -> None:
    venv = Path(sys.prefix)
    stamp = venv / ".installed-dev"
    small = f"--model {tiny_model_dir}"
    done = subprocess.run(
        ["make", "-C", str(ROOT), "-o", str(stamp), "bench", f"VENV={venv}",
         f"BENCH_ARGS={small}",
         "THROUGHPUT_ARGS=--tokens 4 --concurrency 1,2 --repeats 1",
         "BLAS_ARGS=--rows 1 --repeat 1 --matmuls 16x256x256 --tokens 4",
         "HOST_ARGS=--rows 1,2 --tokens 6 --repeats 1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    # engine_throughput: the engine against the raw BatchGenerator, per concurrency.
    assert "| BatchGenerator tok/s | Engine tok/s | ratio |" in out, out[-2000:]
    assert "\n| 1 | " in out and "\n| 2 | " in out, out[-2000:]
    # blas: the reference BLAS against the fast one, with the ratio.
    assert "matmul 16x256x256" in out and "fast/ref" in out, out[-2000:]
    # host_overhead: raw against the engine with 0/50/100% of rows constrained, and the
    # syncs a step (the lane's one wait on the device; prefill and row ends add a few).
    header = "| rows | raw tok/s | engine 0% | / raw | host us/step |"
    assert header in out, out[-2000:]
    table = out[out.index(header):].splitlines()
    rows = {line.split("|")[1].strip(): line for line in table
            if line.startswith("| 1 |") or line.startswith("| 2 |")}
    assert "1" in rows and "2" in rows, out[-2000:]
    syncs = float(rows["2"].split("|")[-2])
    assert 0 < syncs < 5, rows["2"]


def test_the_logprobs_bench_runs_small_and_prints_its_table(tiny_model_dir: Path) -> None:
    # PYTHONPATH: this checkout's packages, whichever one the interpreter installed.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "logprobs.py"), "--model", str(tiny_model_dir),
         "--rows", "2", "--tokens", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "| rows | mode | tokens | decode tok/s | vs no logprobs |" in out, out[-2000:]
    for mode in ("no logprobs", "logprobs", "top_logprobs=5"):
        assert f"| 2 | {mode} | 8 | " in out, out[-2000:]


def _vision_bench(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """``bench/vision.py`` with ``args``, in this checkout's packages."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vision.py"), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})


def test_the_vision_bench_refuses_audio_on_a_family_without_audio() -> None:
    pytest.importorskip("mlx_vlm", reason="the vision bench needs mlx-vlm")
    done = _vision_bench("--family", "qwen3_vl", "--media", "audio", timeout=120)
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Qwen3-VL (qwen3_vl) reads no audio; families that do: gemma4" in done.stderr


def test_the_vision_bench_runs_audio_rows_small() -> None:
    # Gemma 4's tiny zoo checkpoint (built once under ~/.cache, as the bench does), a clip
    # a media row: the table counts the tower per clip.
    pytest.importorskip("mlx_vlm", reason="the vision bench needs mlx-vlm")
    done = _vision_bench("--family", "gemma4", "--media", "audio", "--rows", "1",
                         "--images", "1", "--repeats", "1", timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    for line in ("| tower + projector per clip |", "| audio row TTFT alone |",
                 "| last of 1 audio rows' TTFT beside 1 decoding text rows |",
                 "| text rows' tok/s before the clips / after them |",
                 "| second turn speed-up (goal >= 5x) |"):
        assert line in out, out[-2000:]
