"""One engine sharded over the ranks of ``mx.distributed``: the same script on every rank.

    mlx.launch -n 2 --backend ring examples/sharded.py --model DIR [--shard pipeline]

or by hand, one line per rank (MLX_HOSTFILE: a JSON list, one ["ip:port"] per rank):

    echo '[["127.0.0.1:5000"], ["127.0.0.1:5001"]]' > hosts.json
    MLX_HOSTFILE=hosts.json MLX_RANK=1 python examples/sharded.py --model DIR &
    MLX_HOSTFILE=hosts.json MLX_RANK=0 python examples/sharded.py --model DIR

Rank 0 runs the engine and takes every request (here: a few concurrent prompts); the other
ranks return from ``engine.follow`` only once rank 0's engine closes. The model must split
over the ranks: its heads and KV heads for ``tensor``, its layers for ``pipeline``.
"""

from __future__ import annotations

import argparse

import engine
from engine import Engine, EngineConfig, SamplingParams, TextRequest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--shard", default="tensor", choices=["tensor", "pipeline"])
    args = parser.parse_args()
    config = EngineConfig(shard=args.shard)
    if engine.follow(args.model, config):  # ranks 1..n-1: until rank 0 closes its engine
        return
    with Engine(args.model, config) as eng:
        params = SamplingParams(max_tokens=24, temperature=0.0)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        handles = [eng.submit(TextRequest(p, params)) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            print(f"{prompt!r} -> {handle.result().text!r}")
        stats = eng.stats()
        print(f"rank 0 of a {args.shard}-sharded engine: {stats.steps} steps, "
              f"{stats.generated_tokens} tokens")


if __name__ == "__main__":
    main()
