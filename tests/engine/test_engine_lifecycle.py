"""Construction is cheap, start loads once, and processes exit cleanly with live engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from engine import Engine, FinishReason, TextRequest
from tests.conftest import Turns, greedy, request_for, threads_started_by, wait_until


def test_construction_is_cheap_and_loading_is_lazy(tiny_model_dir: Path) -> None:
    engines: list[Engine] = []
    assert not threads_started_by(lambda: engines.append(Engine(tiny_model_dir)))
    eng = engines[0]
    assert not eng.stats().loaded
    assert eng.submit(TextRequest("hello",
                                  greedy(4))).result(timeout=60).usage.completion_tokens == 4
    assert eng.stats().loaded and eng.stats().context_limit == 2048
    eng.close()
    eng.close()  # idempotent


def test_context_manager_closes(tiny_model_dir: Path) -> None:
    with Engine(tiny_model_dir) as eng:
        started = threads_started_by(eng.start)
    assert started and not any(thread.is_alive() for thread in started)


def test_evicted_rows_release_their_kv_memory(make_engine) -> None:  # type: ignore[no-untyped-def]
    turns = Turns()
    eng = make_engine(max_batch=4, probe=turns.probe)
    tokens: list[int] = []
    handles = [eng.submit(request_for(f"row {i} " * 50, greedy(1500)), on_token=lambda t,
                          _: tokens.append(t))
               for i in range(3)]
    wait_until(lambda: len(tokens) > 30)
    assert turns.last.batch_kv_bytes > 0
    for h in handles:
        h.cancel()
    assert all(h.result().finish_reason is FinishReason.CANCELLED for h in handles)
    settled = turns.settled()
    assert settled.batch_kv_bytes == 0 and settled.lane_rows == {"batch": 0, "serial": 0}


def test_stats_report_mlx_allocator_memory(make_engine, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine()
    tokens: list[int] = []
    handle = eng.submit(request_for("count " * 40, greedy(400)), on_token=lambda t,
                        _: tokens.append(t))
    wait_until(lambda: len(tokens) > 20)
    # Live arrays hold at least the weights (safetensors files: weights plus small headers)
    # and what the prefix store keeps.
    weights = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    during = eng.stats()
    assert during.mlx_active_bytes >= 0.95 * weights + during.prefix_bytes
    handle.cancel()
    handle.result()
    wait_until(lambda: eng.stats().running == 0)


def test_process_exits_cleanly_with_an_engine_still_open(tiny_model_dir: Path) -> None:
    script = textwrap.dedent(f"""
        import engine
        from engine import Engine, SamplingParams, TextRequest
        eng = Engine({str(tiny_model_dir)!r})
        request = TextRequest("bye " * 20, SamplingParams(max_tokens=1500))
        handles = [eng.submit(request) for _ in range(4)]
        next(iter(handles[0]))
        print("exiting with rows in flight", flush=True)
    """)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).parents[2])
        assert done.returncode == 0, done.stderr[-2000:]
        assert "exiting with rows in flight" in done.stdout
