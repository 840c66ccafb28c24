"""Two ranks over loopback (mx.distributed ring backend), one engine sharded across them.

Each test starts ``rank_main.py`` twice (MLX_HOSTFILE with two loopback ports, MLX_RANK 0
and 1), in their own process groups, under a hard timeout that kills both groups: a
collective one rank skips blocks the other forever. Rank 0's outputs are compared with
one process on the same tiny qwen2 (4 heads, 2 KV heads, 4 layers: both splits work).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.conftest import request_for
from tests.distributed.rank_main import PROMPTS

pytestmark = pytest.mark.distributed

RANK_MAIN = Path(__file__).with_name("rank_main.py")
ROOT = Path(__file__).resolve().parents[2]
HARD_TIMEOUT = 120.0


@dataclass
class RankRun:
    results: list[dict[str, object]]  # by rank
    returncodes: list[int | None]
    logs: list[str]
    follower_seconds: float = 0.0  # from killing rank 0 to the follower's end


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _launch_ranks(tmp_path: Path, argv: list[str], logs: list[Path],
                  env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """The same program on two ranks over loopback (rank 1 first), each in its own process
    group with its output in ``logs[rank]``; returns [rank 1, rank 0]."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    base = {**os.environ, "MLX_HOSTFILE": str(hostfile), **(env or {})}
    procs = []
    for rank in (1, 0):
        with logs[rank].open("wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, *argv], env={**base, "MLX_RANK": str(rank)}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))
    return procs


def run_ranks(tmp_path: Path, model: Path, shard: str, scenario: str, *,
              distributed_timeout: float = 60.0,
              signal_follower: int | None = None,
              signal_leader: int | None = None, script: Path = RANK_MAIN,
              hard_timeout: float = HARD_TIMEOUT) -> RankRun:
    """Both ranks of ``script`` to the end (or killed at ``hard_timeout``);
    ``signal_follower`` is sent to rank 1 (``signal_leader`` to rank 0) once rank 0 prints
    DECODING."""
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = _launch_ranks(tmp_path, [str(script), str(model), shard, scenario,
                                     str(distributed_timeout)], logs, env)
    follower, leader = procs
    deadline = time.monotonic() + hard_timeout
    killed_at = follower_seconds = 0.0
    try:
        if signal_follower is not None or signal_leader is not None:
            while b"DECODING" not in logs[0].read_bytes():
                if time.monotonic() > deadline or leader.poll() is not None:
                    break
                time.sleep(0.05)
            if signal_follower is not None:
                _kill_group(follower, signal_follower)
            if signal_leader is not None:
                _kill_group(leader, signal_leader)
                killed_at = time.monotonic()
        order = (follower, leader) if signal_leader is not None else (leader, follower)
        for proc in order:
            left = deadline - time.monotonic()
            if (proc is follower and signal_follower is not None) or (
                    proc is leader and signal_leader is not None):
                left = min(left, 5.0)  # a stopped rank never ends by itself
            try:
                proc.wait(max(1.0, left))
                if proc is follower and signal_leader is not None:
                    follower_seconds = time.monotonic() - killed_at
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    results: list[dict[str, object]] = []
    for text in texts:
        found = [json.loads(line[len("RESULT "):]) for line in text.splitlines()
                 if line.startswith("RESULT ")]
        results.append(found[-1] if found else {})
    return RankRun(results, [leader.returncode, follower.returncode], texts, follower_seconds)


@pytest.fixture(scope="module")
def reference(shardable_model_dir: Path) -> dict[str, list[list[int]]]:
    """What one process makes of the prompts: 16 and 40 greedy tokens each, alone."""
    eng = Engine(shardable_model_dir, EngineConfig(max_batch=8, prefill_chunk=64)).start()
    try:
        out: dict[str, list[list[int]]] = {}
        for n in (16, 40):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            out[str(n)] = [list(eng.submit(request_for(p, params)).result(timeout=60).token_ids)
                           for p in PROMPTS]
        return out
    finally:
        eng.close()


def _assert_clean(run: RankRun) -> None:
    assert run.returncodes == [0, 0], run.logs
    assert run.results[1].get("followed") is True, run.logs


def _follower_agrees(run: RankRun, lists: list[list[int]]) -> None:
    """Every token list rank 0 returned is what the follower's own shard computed."""
    theirs = run.results[1]["tokens"]
    assert isinstance(theirs, list)
    for mine in lists:
        assert any(t[: len(mine)] == mine for t in theirs), (mine, theirs)


@pytest.mark.parametrize("shard", ["tensor", "pipeline"])
def test_greedy_rows_match_one_process(tmp_path: Path, shardable_model_dir: Path,
                                       reference: dict[str, list[list[int]]],
                                       shard: str) -> None:
    run = run_ranks(tmp_path, shardable_model_dir, shard, "greedy")
    _assert_clean(run)
    assert run.results[0]["tokens"] == reference["16"]  # six concurrent rows
    _follower_agrees(run, reference["16"])
    # Refused on rank 0 (at submit, and when prepared): the follower never saw them.
    assert run.results[0]["refused"] == ["ValueError", "ContextLengthError"]
    assert len(run.results[1]["tokens"]) == len(PROMPTS)  # type: ignore[arg-type]


def test_cancel_mid_decode_leaves_ranks_in_step(tmp_path: Path, shardable_model_dir: Path,
                                                reference: dict[str, list[list[int]]]) -> None:
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", "cancel")
    _assert_clean(run)
    result = run.results[0]
    assert result["victim_reason"] == "cancelled"
    assert isinstance(result["victim_tokens"], int) and result["victim_tokens"] < 40
    # The siblings decode as if the cancelled row had never been there...
    assert result["tokens"] == [reference["40"][0], reference["40"][2]]
    # ...and a request after the cancellation still agrees on both ranks.
    assert result["after"] == reference["16"][3]
    _follower_agrees(run, [*result["tokens"], result["after"]])


@pytest.mark.parametrize("scenario", ["sample", "grammar"])
def test_sampling_and_grammar_agree_across_ranks(tmp_path: Path, shardable_model_dir: Path,
                                                 scenario: str) -> None:
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", scenario)
    _assert_clean(run)
    tokens = run.results[0]["tokens"]
    assert isinstance(tokens, list) and all(tokens)
    _follower_agrees(run, tokens)
    if scenario == "grammar":
        for text in run.results[0]["texts"]:  # type: ignore[attr-defined]
            assert isinstance(json.loads(text)["n"], int)


def test_killed_follower_kills_the_engine_within_the_bound(tmp_path: Path,
                                                          shardable_model_dir: Path) -> None:
    # A broadcast to a dead peer raises at once; a model step whose all_sum was in flight
    # was seen to hang although the ring reported the lost peer: the watchdog bounds it.
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", "kill", distributed_timeout=5.0,
                    signal_follower=signal.SIGKILL)
    assert run.returncodes[0] == 0, run.logs
    result = run.results[0]
    assert str(result["error"]).startswith("EngineDeadError"), run.logs
    assert result["later_submit"] == "EngineDeadError"
    assert float(result["seconds_after_decoding"]) < 5 + 10  # type: ignore[arg-type]


def test_stopped_follower_kills_the_engine_within_the_timeout(
        tmp_path: Path, shardable_model_dir: Path) -> None:
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", "kill",
                    distributed_timeout=3.0, signal_follower=signal.SIGSTOP)
    assert run.returncodes[0] == 0, run.logs  # rank 0 ends although rank 1 never answers
    result = run.results[0]
    assert "did not answer within 3 s" in str(result["error"]), run.logs
    assert result["later_submit"] == "EngineDeadError"
    assert float(result["seconds_after_decoding"]) < 3 + 10  # type: ignore[arg-type]


def test_killed_rank0_ends_the_follower(tmp_path: Path, shardable_model_dir: Path) -> None:
    # Waiting for a message (almost always) follow() raises at once; inside the model's
    # all_sum the follower may instead hang until its patience (5 s + 2.5 s) ends it.
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", "kill", distributed_timeout=5.0,
                    signal_leader=signal.SIGKILL)
    assert run.returncodes[0] == -signal.SIGKILL
    assert run.returncodes[1] not in (0, None), run.logs
    assert ("connection to a peer was lost" in run.logs[1]
            or run.returncodes[1] == 70), run.logs
    assert run.follower_seconds < 7.5 + 5, run.logs


def _http(url: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("ending", ["sigterm_rank0", "kill_follower"])
def test_server_on_rank0_followers_on_the_rest(tmp_path: Path, shardable_model_dir: Path,
                                               ending: str) -> None:
    """``mlx-providers serve --shard tensor`` on both ranks: rank 0 serves, rank 1 follows."""
    ports = _free_ports(3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:2]]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mlx_providers.server", "serve", "--model",
           str(shardable_model_dir), "--served-model-name", "tiny", "--shard", "tensor",
           "--distributed-timeout", "5", "--port", str(ports[2])]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    for rank in (0, 1):
        with logs[rank].open("wb") as out:
            procs.append(subprocess.Popen(cmd, env={**env, "MLX_RANK": str(rank)}, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    leader, follower = procs
    base = f"http://127.0.0.1:{ports[2]}"
    chat = {"model": "tiny", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _http(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and leader.poll() is None, logs[0].read_text()
            time.sleep(0.2)
        status, answer = _http(base + "/v1/chat/completions", chat)
        assert status == 200, answer
        if ending == "sigterm_rank0":
            leader.send_signal(signal.SIGTERM)
            assert follower.wait(30) == 0, logs[1].read_text()  # told to stop, not orphaned
            leader.wait(30)
        else:
            _kill_group(follower)
            follower.wait(30)
            # Found while idle (rank 0 checks on its followers every 2.5 s here).
            killed = time.monotonic()
            while _http(base + "/health")[0] != 503:
                assert time.monotonic() - killed < 15, logs[0].read_text()
                time.sleep(0.2)
            status, answer = _http(base + "/v1/chat/completions", chat)
            assert status == 503, answer
            error = answer["error"]
            assert isinstance(error, dict) and error["code"] == "engine_unavailable"
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()


def test_stopped_rank0_ends_the_follower_within_its_patience(
        tmp_path: Path, shardable_model_dir: Path) -> None:
    # distributed_timeout 3 s + the idle heartbeat 1.5 s: the follower gives up after 4.5 s
    # without a message, whether it waited for one or sat inside the model's all_sum.
    run = run_ranks(tmp_path, shardable_model_dir, "tensor", "kill", distributed_timeout=3.0,
                    signal_leader=signal.SIGSTOP)
    assert run.returncodes[1] == 70, run.logs
    assert "rank 0 sent nothing for 4.5 s" in run.logs[1], run.logs
    assert run.follower_seconds < 4.5 + 5, run.logs


def test_the_sharded_example_runs_on_two_ranks(tmp_path: Path,
                                              shardable_model_dir: Path) -> None:
    """``examples/sharded.py`` as its docstring runs it by hand: one line per rank."""
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = _launch_ranks(tmp_path, [str(ROOT / "examples" / "sharded.py"),
                                     "--model", str(shardable_model_dir)], logs)
    deadline = time.monotonic() + HARD_TIMEOUT
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    assert [p.returncode for p in procs] == [0, 0], texts
    assert "rank 0 of a tensor-sharded engine" in texts[0], texts[0]
    assert texts[0].count(" -> ") == 3, texts[0]
