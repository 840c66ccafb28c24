"""Every example runs to completion on the default model, the way its docstring says.

Each runs in a subprocess of its own (as a user runs it) under a hard timeout, and must
exit 0 with its closing line printed: an example that dies (as ``llama_index_agents.py``
once did, on a forced call cut by ``max_tokens``) fails here instead of in a user's hands.
The sharded example, which needs two ranks and a model that splits, runs in
``tests/distributed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
HARD_TIMEOUT = 600.0
# example -> (its arguments, text its last lines must hold)
EXAMPLES = {
    "demo.py": ([], "One engine for both frameworks and both models"),
    "langchain_parallel.py": ([], "peak rows decoding together"),
    "llama_index_agents.py": ([], "6 agents in"),
    "server.py": ([], "previous_response_id"),
}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_the_example_runs_to_completion(example: str) -> None:
    args, closing = EXAMPLES[example]
    try:
        done = subprocess.run([sys.executable, str(ROOT / "examples" / example), *args],
                              cwd=ROOT, env=dict(os.environ), capture_output=True,
                              text=True, timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{example} did not end within {HARD_TIMEOUT:.0f} s: {exc.stdout!r}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{example} exited {done.returncode}:\n{output[-3000:]}"
    assert closing in done.stdout, f"{example} did not print {closing!r}:\n{output[-3000:]}"
