"""A process ends cleanly after any failure: a dead engine, a closed one, and Ctrl-C during a
load, a prefill or a decode. Each case is its own interpreter under a hard timeout.

The contract for Ctrl-C: KeyboardInterrupt reaches the main thread wherever it waits on the
engine (``start``, ``result``, a stream); a script that catches it exits 0, and one that does
not dies of SIGINT as any Python script does (status -2), never of an abort ("terminate
called without an active exception", SIGABRT) and never by hanging. At exit the engine is
closed (atexit): its thread ends its step, releases its MLX stream and stops.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUNS = 2  # the abort this guards against came in most runs, not all
TIMEOUT = 90.0

PRELUDE = """
import sys, time
import engine
from engine import (Engine, EngineConfig, EngineClosedError, EngineDeadError,
                    SamplingParams, StepProbe, TextRequest)
MODEL = {model!r}
def say(word):
    print(word, flush=True)
"""

ENDINGS = {
    "a dead engine": """
        probe = StepProbe()
        eng = Engine(MODEL, EngineConfig(max_consecutive_step_failures=2), probe=probe).start()
        probe.fail_always(RuntimeError("the device fell over"))
        for _ in range(10):  # each failed step fails its rows; the second in a row kills
            try:
                eng.submit(TextRequest("hello", SamplingParams(max_tokens=50))).result(timeout=60)
            except EngineDeadError:
                say("dead")
                break
            except engine.EngineError:
                continue
    """,
    "a closed engine, closed while rows decode": """
        probe = StepProbe()
        probe.slow_steps(0.02)
        eng = Engine(MODEL, probe=probe).start()
        request = TextRequest("hello", SamplingParams(max_tokens=500, ignore_eos=True))
        handles = [eng.submit(request) for _ in range(4)]
        while eng.stats().generated_tokens < 8:
            time.sleep(0.01)
        eng.close()
        for handle in handles:
            try:
                handle.result(timeout=60)
            except EngineClosedError:
                pass
        try:
            eng.submit(TextRequest("again"))
        except EngineClosedError:
            say("closed")
    """,
    "an engine left open at exit, rows still decoding": """
        probe = StepProbe()
        probe.slow_steps(0.02)
        eng = Engine(MODEL, probe=probe).start()
        request = TextRequest("hello", SamplingParams(max_tokens=1500, ignore_eos=True))
        handles = [eng.submit(request) for _ in range(4)]
        while eng.stats().generated_tokens < 8:
            time.sleep(0.01)
        say("left open")
    """,
}


@pytest.mark.parametrize("case", list(ENDINGS))
def test_the_process_exits_zero_after(tiny_model_dir: Path, case: str) -> None:
    script = PRELUDE.format(model=str(tiny_model_dir)) + textwrap.dedent(ENDINGS[case])
    for _ in range(RUNS):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
        assert done.stdout.strip(), done.stderr[-2000:]  # it reached its last line
        assert "terminate called" not in done.stderr


# Where the main thread waits when Ctrl-C comes. Each prints "ready" once the engine is in
# that phase; the loads are slowed (after mlx-lm loaded the weights, on the engine thread)
# and the steps too, so the phase lasts long enough for the signal to land inside it.
PHASES = {
    "load": """
        import engine.device.loading.loader as loader
        real_load = loader.mlx_load
        def slow_load(*args, **kwargs):
            loaded = real_load(*args, **kwargs)
            say("ready")
            time.sleep(3)
            return loaded
        loader.mlx_load = slow_load
        eng = Engine(MODEL)
        eng.start()
    """,
    "prefill": """
        probe = StepProbe()
        probe.slow_steps(0.05)
        eng = Engine(MODEL, EngineConfig(prefill_chunk=8), probe=probe).start()
        handle = eng.submit(TextRequest("word " * 400, SamplingParams(max_tokens=4)))  # 800 tokens
        while eng.stats().running == 0 and not handle.done:
            time.sleep(0.005)
        assert eng.stats().generated_tokens == 0
        say("ready")
        handle.result()
    """,
    "decode": """
        probe = StepProbe()
        probe.slow_steps(0.02)
        eng = Engine(MODEL, probe=probe).start()
        handle = eng.submit(TextRequest("hello", SamplingParams(max_tokens=1500,
                                                                ignore_eos=True)))
        events = iter(handle)  # one iterator: dropping one after a break cancels the row
        for event in events:
            if eng.stats().generated_tokens >= 4:
                say("ready")
                break
        for event in events:
            pass
    """,
}

CAUGHT = """
try:
{body}
except KeyboardInterrupt:
    say("interrupted")
    sys.exit(0)
"""


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted(script: str) -> tuple[int, str, str]:
    """Run ``script``, send SIGINT once it says "ready"; its status, stdout, stderr."""
    # A terminal's process gets Ctrl-C; one started in the background (``make test &``, some
    # CI runners) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=_sigint_as_in_a_terminal)
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        lines = []
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            lines.append(line)
            if line.strip() == "ready" or not line:
                break
        assert lines and lines[-1].strip() == "ready", (lines, child.stderr and
                                                        child.stderr.read()[-2000:])
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, "".join(lines) + out, err


@pytest.mark.parametrize("phase", list(PHASES))
def test_ctrl_c_caught_by_the_script_exits_zero(tiny_model_dir: Path, phase: str) -> None:
    body = textwrap.indent(textwrap.dedent(PHASES[phase]), "    ")
    script = PRELUDE.format(model=str(tiny_model_dir)) + CAUGHT.format(body=body)
    for _ in range(RUNS):
        status, out, err = _interrupted(script)
        assert status == 0, (status, out, err[-2000:])
        assert "interrupted" in out, err[-2000:]
        assert "terminate called" not in err


@pytest.mark.parametrize("phase", list(PHASES))
def test_ctrl_c_not_caught_ends_the_process_by_sigint(tiny_model_dir: Path,
                                                      phase: str) -> None:
    script = PRELUDE.format(model=str(tiny_model_dir)) + textwrap.dedent(PHASES[phase])
    status, out, err = _interrupted(script)
    assert status == -signal.SIGINT, (status, out, err[-2000:])
    assert "KeyboardInterrupt" in err
    assert "terminate called" not in err
