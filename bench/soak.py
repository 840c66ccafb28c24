"""Soak: the CI churn workload (testkit/churn.py) for many rounds, with memory after each.

Every round sends ``--per-round`` requests of every kind from threads, asyncio and trio,
cancelled at every stage, then waits for the engine to drain and prints: requests so far,
rows left running or pending (leaks), live grammar matchers, errors so far, MLX active and
cached memory, the prefix store's bytes, and process RSS. After the warm-up rounds RSS and
active memory minus the prefix store must stop growing with the requests served.

    python bench/soak.py [--model DIR] [--rounds 20] [--per-round 1000] [--prefix-cache-mb 64]

Without ``--model`` it builds the suite's tiny random-weight model in a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testkit.churn import Churn, rss_bytes
from testkit.tiny_model import build_tiny_model

MB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--prefix-cache-mb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny")
            build_tiny_model(Path(model))
        config = EngineConfig(max_batch=args.max_batch,
                              prefix_cache_bytes=args.prefix_cache_mb * MB)
        with Engine(model, config) as eng:
            churn = Churn(eng, seed=1)
            print(f"{'requests':>9} {'leaked':>6} {'matchers':>8} {'errors':>6} "
                  f"{'needle!=':>8} {'active MB':>9} {'cached MB':>9} {'prefix MB':>9} "
                  f"{'active-prefix':>13} {'RSS MB':>7} {'s':>5}")
            started = time.perf_counter()
            for round_ in range(args.rounds):
                churn.run_round(args.per_round, start=round_ * args.per_round)
                while (stats := eng.stats()).running or stats.pending:
                    time.sleep(0.05)
                time.sleep(0.3)  # the engine collects cycles once idle, then republishes
                stats = eng.stats()
                report = churn.report
                errors = sum(n for outcome, n in report.outcomes.items() if outcome[0].isupper()
                             or outcome.startswith("_"))
                active, prefix = stats.mlx_active_bytes / MB, stats.prefix_bytes / MB
                print(f"{report.submitted:>9} {stats.running + stats.pending:>6} "
                      f"{stats.live_matchers:>8} {errors:>6} {report.needle_mismatches:>8} "
                      f"{active:>9.1f} {stats.mlx_cache_bytes / MB:>9.1f} {prefix:>9.1f} "
                      f"{active - prefix:>13.1f} {rss_bytes() / MB:>7.1f} "
                      f"{time.perf_counter() - started:>5.0f}", flush=True)


if __name__ == "__main__":
    main()
