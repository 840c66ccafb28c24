"""The command line's entry points and its ``--adapter`` checks: ``python -m
mlx_providers.server.cli`` and ``python -m mlx_providers.server`` in subprocesses, and
``serve`` in-process with the model and uvicorn stood in for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_providers.server import cli
from tests.fake_engine import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True,
                          text=True, timeout=90, cwd=ROOT)


def adapter_dir(root: Path, *files: str) -> Path:
    root.mkdir(parents=True)
    for name in files:
        (root / name).write_text(json.dumps({"fine_tune_type": "lora", "lora_parameters": {
            "rank": 8, "scale": 2.0}}) if name.endswith(".json") else "")
    return root


@pytest.mark.parametrize(("command", "says"), [
    (["mlx_providers.server.cli", "serve", "--help"], "--allow-adapter-paths"),
    (["mlx_providers.server.cli", "--help"], "{serve}"),
    (["mlx_providers.server", "--help"], "{serve}"),
    (["mlx_providers.server", "serve", "--help"], "--adapter NAME=DIR"),
])
def test_both_modules_answer_help(command: list[str], says: str) -> None:
    done = run(*command)
    assert done.returncode == 0, done.stderr
    assert says in done.stdout


def test_the_cli_module_checks_adapters_before_loading(tmp_path: Path) -> None:
    """Run as ``-m mlx_providers.server.cli``, ``serve`` reaches the adapter check (the main
    guard once ran before ``adapter_names`` was defined) and exits naming the flag."""
    partial = adapter_dir(tmp_path / "partial", "adapter_config.json")
    done = run("mlx_providers.server.cli", "serve", "--model", str(tmp_path / "no-model"),
               "--adapter", f"x={partial}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        f"--adapter 'x={partial}': {partial} has no adapters.safetensors "
        "(mlx-lm's LoRA format: adapter_config.json and adapters.safetensors)")


@pytest.mark.parametrize(("value", "says"), [
    ("x", "give NAME=DIR"),
    ("a:b={ok}", "give NAME=DIR"),
    ("x={missing}", "is not a directory"),
    ("x={empty}", "has no adapter_config.json or adapters.safetensors"),
])
def test_a_bad_adapter_flag_exits_naming_it(tmp_path: Path, value: str, says: str) -> None:
    paths = {"ok": adapter_dir(tmp_path / "ok", *cli.ADAPTER_FILES),
             "empty": adapter_dir(tmp_path / "empty"), "missing": tmp_path / "missing"}
    with pytest.raises(SystemExit) as raised:
        cli.adapter_names([value.format(**paths)])
    message = str(raised.value.code)
    assert message.startswith("--adapter ") and says in message


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    ok = adapter_dir(tmp_path / "ok", *cli.ADAPTER_FILES)
    assert cli.adapter_names([f"x={ok}"]) == {"x": str(ok)}
    with pytest.raises(SystemExit, match="given twice"):
        cli.adapter_names([f"x={ok}", f"x={ok}"])


@pytest.mark.parametrize("flags", [[], ["--allow-adapter-paths"]])
def test_serve_hands_the_adapters_and_the_opt_in_to_the_app(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    import uvicorn

    ok = adapter_dir(tmp_path / "ok", *cli.ADAPTER_FILES)
    fake = ScriptedEngine()
    apps: list[Any] = []
    monkeypatch.setattr(cli, "get_engine", lambda model, **config: fake)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: apps.append(app))
    argv = ["serve", "--model", str(tmp_path / "m"), "--served-model-name", "m",
            "--embedding-model", "none", "--adapter", f"x={ok}", *flags]
    assert cli.main(argv) == 0
    settings = apps[0].state.ctx.settings
    assert dict(settings.adapters) == {"x": str(ok)}
    assert settings.allow_adapter_paths is bool(flags)
    assert not fake.usable  # closed when uvicorn returned


def test_the_adapters_byte_cap_is_an_engine_option() -> None:
    args = cli.parser().parse_args(["serve", "--adapter-bytes", "4096"])
    assert cli.engine_config(args)["adapter_bytes"] == 4096
    assert "adapter_bytes" not in cli.engine_config(cli.parser().parse_args(["serve"]))
