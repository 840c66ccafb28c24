"""What replicating the engine's plan costs: rank 0's broadcast per step beside the step.

Starts itself as two ranks over loopback (ring backend, a temporary hostfile), shards a
model (tensor or pipeline) and decodes 1, 8 and 16 greedy rows together. From rank 0's
link: broadcast ms and bytes per step (the queued inserts/removes and the step, sent as
two ``all_sum`` calls); from ``Engine.stats()``: the mean sharded step (broadcast
included) — beside one process's step on the same model. Then the same at 8 rows with a
JSON-schema constraint on every row: each rank computes its own grammar masks, and the
table shows what broadcasting rank 0's masks instead would send per step.

    python bench/distributed_broadcast.py [--model DIR] [--shard tensor|pipeline] [--tokens 64]

Without ``--model`` it builds the tests' tiny qwen2 (4 heads, 2 KV heads, 4 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig, JsonSchema, SamplingParams, TextRequest  # noqa: E402

ROWS = (1, 8, 16)
SCHEMA = JsonSchema({"type": "object", "properties": {
    "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]})


def prompts(n: int, run: int) -> list[str]:
    return [f"def handler_{run}_{i}(request):\n    " for i in range(n)]


def measure(eng: Engine, rows: int, tokens: int, run: int,
            constraint: JsonSchema | None = None) -> dict[str, float]:
    """Mean step ms, and broadcast ms and bytes per step when sharded."""
    link = eng._lanes.link if eng._lanes is not None else None  # bench-only peek
    before = eng.stats()
    sent0 = (link.channel.sent_bytes, link.channel.messages, link.broadcast_seconds) \
        if link is not None else (0, 0, 0.0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=constraint is None,
                            constraint=constraint)
    handles = [eng.submit(TextRequest(p, params)) for p in prompts(rows, run)]
    for h in handles:
        h.result(timeout=600)
    after = eng.stats()
    steps = max(1, after.steps - before.steps)
    out = {"step_ms": 1e3 * (after.step_seconds - before.step_seconds) / steps,
           "steps": float(steps)}
    if link is not None:
        sent, messages, seconds = (link.channel.sent_bytes - sent0[0],
                                   link.channel.messages - sent0[1],
                                   link.broadcast_seconds - sent0[2])
        out.update(bcast_ms=1e3 * seconds / max(1, messages), bytes=sent / max(1, messages))
    return out


def rank_main(model: str, shard: str | None, tokens: int) -> None:
    config = EngineConfig(max_batch=16, prefill_batch=16, prefill_chunk=256,
                          shard=shard)  # type: ignore[arg-type]
    if engine.follow(model, config):
        return
    eng = Engine(model, config).start()
    measure(eng, 2, 8, 0)  # warm-up
    table: dict[str, Any] = {}
    for run, rows in enumerate(ROWS, 1):
        table[str(rows)] = measure(eng, rows, tokens, run)
    table["grammar8"] = measure(eng, 8, tokens, 9, constraint=SCHEMA)
    table["vocab"] = eng._model.vocab_size if eng._model is not None else 0
    eng.close()
    print("RESULT " + json.dumps(table), flush=True)


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_two_ranks(model: str, shard: str, tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _ports(2)]))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, __file__, "--rank-main", "--model", model, "--shard", shard,
               "--tokens", str(tokens)]
        follower = subprocess.Popen(cmd, env={**env, "MLX_RANK": "1"},
                                    start_new_session=True)
        try:
            out = subprocess.run(cmd, env={**env, "MLX_RANK": "0"}, capture_output=True,
                                 text=True, timeout=900, check=True).stdout
            follower.wait(60)
        finally:
            if follower.poll() is None:
                follower.kill()
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


def run_one_process(model: str, tokens: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--rank-main", "--model", model,
                          "--tokens", str(tokens)], capture_output=True, text=True,
                         timeout=900, check=True, env={k: v for k, v in os.environ.items()
                                                       if k not in ("MLX_HOSTFILE",
                                                                    "MLX_RANK")}).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--shard", default="tensor", choices=["tensor", "pipeline"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args.model, args.shard if "MLX_HOSTFILE" in os.environ else None,
                  args.tokens)
        return
    model = args.model
    if model is None:
        from testkit.tiny_model import build_tiny_model

        model = str(Path(tempfile.gettempdir()) / "mlx-providers-bench-tiny-shardable")
        if not (Path(model) / "config.json").exists():
            build_tiny_model(Path(model), heads=4, kv_heads=2, layers=4)
    one = run_one_process(model, args.tokens)
    two = run_two_ranks(model, args.shard, args.tokens)
    print(f"model {model}, {args.shard} split over 2 ranks (ring, loopback), "
          f"{args.tokens} tokens per row, {engine.blas_info().name}")
    print(f"{'rows':>8} {'1-proc step ms':>15} {'sharded step ms':>16} {'bcast ms':>9} "
          f"{'bcast %':>8} {'bytes/step':>11}")
    for key in [*map(str, ROWS), "grammar8"]:
        a, b = one[key], two[key]
        print(f"{key:>8} {a['step_ms']:>15.2f} {b['step_ms']:>16.2f} {b['bcast_ms']:>9.3f} "
              f"{100 * b['bcast_ms'] / b['step_ms']:>7.1f}% {b['bytes']:>11.0f}")
    mask_bytes = 8 * ((int(two["vocab"]) + 31) // 32) * 4
    print(f"grammar masks: each rank computes its own (grammar8 row above); broadcasting "
          f"rank 0's would add {mask_bytes} bytes/step ({mask_bytes // 8} per row, "
          f"vocab {two['vocab']}) and a third all_sum")


if __name__ == "__main__":
    main()
