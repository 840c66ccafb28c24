"""A model that cannot be loaded: the call that needed it raises a ``ModelLoadError`` (an
``EngineDeadError``) naming the model, of the ``OSError`` family when its files could not be
had (``ModelUnavailableError``) and of the ``ValueError`` family when they cannot be run
(``ModelFormatError``), whose ``__cause__`` is the load error itself; a retry works once the
cause is fixed; and the process exits 0 afterwards.

Each case runs in its own interpreter (the failure this guards against was an abort at
interpreter exit, "terminate called without an active exception", status 134), several
times, since it came in most runs, not all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUNS = 3

CASES = {
    "missing path, start() then close()": """
        from engine import Engine, EngineDeadError, ModelUnavailableError
        eng = Engine("/nonexistent/model-dir")
        try:
            eng.start()
        except EngineDeadError as exc:
            assert isinstance(exc.__cause__, FileNotFoundError), repr(exc.__cause__)
            assert isinstance(exc, ModelUnavailableError) and isinstance(exc, OSError), exc
            assert "/nonexistent/model-dir" in str(exc), exc
            print("caught", type(exc).__name__)
        eng.close()
    """,
    "missing path through the shared registry, then a retry with the fixed path": """
        from engine import get_engine, EngineDeadError, TextRequest
        try:
            get_engine("/nonexistent/model-dir").submit(TextRequest("hi")).result(timeout=60)
        except EngineDeadError as exc:
            assert isinstance(exc.__cause__, FileNotFoundError), repr(exc.__cause__)
            assert isinstance(exc, OSError), repr(exc)
            print("caught", type(exc).__name__)
        eng = get_engine(MODEL)
        assert eng.submit(TextRequest("hi", max_tokens_param(4))).result(timeout=60).token_ids
        print("retried")
    """,
    "a directory that is not a model": """
        import tempfile
        from engine import Engine, EngineDeadError
        with tempfile.TemporaryDirectory() as empty:
            eng = Engine(empty)
            try:
                eng.start()
            except EngineDeadError as exc:  # config.json is missing
                assert isinstance(exc.__cause__, FileNotFoundError), repr(exc.__cause__)
                assert isinstance(exc, OSError), repr(exc)
                assert empty in str(exc), exc
                print("caught", type(exc).__name__)
            eng.close()
    """,
    "a corrupt .gguf file": """
        import tempfile, os
        from engine import Engine, EngineDeadError
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "broken.gguf")
            open(path, "wb").write(b"not a gguf file at all")
            eng = Engine(path)
            try:
                eng.start()
            except EngineDeadError as exc:
                assert isinstance(exc.__cause__, (ValueError, OSError)), repr(exc.__cause__)
                family = OSError if isinstance(exc.__cause__, OSError) else ValueError
                assert isinstance(exc, family), repr(exc)  # the cause's family
                assert "broken.gguf" in str(exc), exc
                print("caught", type(exc).__name__)
            eng.close()
    """,
    "an architecture mlx-lm does not ship, then a corrupt config": """
        import json, tempfile, os, shutil
        from engine import Engine, ModelFormatError
        with tempfile.TemporaryDirectory() as folder:
            shutil.copytree(MODEL, folder, dirs_exist_ok=True)  # real weights and tokenizer
            config = os.path.join(folder, "config.json")
            with open(config) as f:
                fields = json.load(f)
            with open(config, "w") as f:
                json.dump({**fields, "model_type": "no-such-architecture"}, f)
            try:
                Engine(folder).start()
            except ValueError as exc:
                assert isinstance(exc, ModelFormatError), repr(exc)
                assert "no-such-architecture" in str(exc) and folder in str(exc), exc
                print("caught", type(exc).__name__)
            with open(config, "w") as f:
                f.write("{not json")
            try:
                Engine(folder).start()
            except ValueError as exc:
                assert isinstance(exc, ModelFormatError), repr(exc)
                assert folder in str(exc), exc
                print("caught", type(exc).__name__)
    """,
}

PRELUDE = """
import engine
from engine import SamplingParams
MODEL = {model!r}
def max_tokens_param(n):
    return SamplingParams(max_tokens=n, temperature=0.0)
"""


@pytest.mark.parametrize("case", list(CASES))
def test_a_load_failure_raises_by_kind_and_the_process_exits_cleanly(
        tiny_model_dir: Path, case: str) -> None:
    script = PRELUDE.format(model=str(tiny_model_dir)) + textwrap.dedent(CASES[case])
    for _ in range(RUNS):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
        assert "caught" in done.stdout, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
