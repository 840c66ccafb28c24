"""One rank of a two-rank test: ``python rank_main.py MODEL SHARD SCENARIO [TIMEOUT]``.

Started by tests/distributed/test_sharded.py with ``MLX_HOSTFILE`` and ``MLX_RANK`` set.
Rank 0 runs an Engine and prints one JSON line ``{"rank": 0, ...}``; the other rank calls
``engine.follow`` and prints ``{"rank": 1, "followed": ...}`` once rank 0 shut it down.
Scenarios: ``greedy`` (concurrent rows), ``cancel`` (one row cancelled mid decode),
``sample`` (random sampling), ``grammar`` (a JSON-schema constraint), ``kill`` (rank 0
decodes until the harness kills the follower; prints how the engine died).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import engine
from engine import Engine, EngineConfig, EngineDeadError, JsonSchema, SamplingParams, TextRequest
from tests.conftest import request_for

PROMPTS = ["def main(", "import os\nimport", "class Parser:\n    def", "for i in range(",
           "The quick brown", "return self."]


def emit(payload: dict[str, object]) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


def run_rank0(eng: Engine, scenario: str) -> dict[str, object]:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    if scenario == "greedy":
        refused = []  # requests that fail validation never reach the other ranks
        try:
            eng.submit(request_for(PROMPTS[0], SamplingParams(logits_processors=(lambda t, x: x,))))
        except ValueError as exc:
            refused.append(type(exc).__name__)
        too_long = eng.submit(request_for(PROMPTS[0], SamplingParams(max_tokens=100_000)))
        try:
            too_long.result(timeout=60)
        except Exception as exc:
            refused.append(type(exc).__name__)
        handles = [eng.submit(request_for(p, greedy)) for p in PROMPTS]
        return {"tokens": [list(h.result(timeout=60).token_ids) for h in handles],
                "refused": refused}
    if scenario == "sample":
        params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
        seeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=7)
        handles = [eng.submit(request_for(p, params)) for p in PROMPTS[:3]]
        handles.append(eng.submit(request_for(PROMPTS[3], seeded)))  # the serial lane
        return {"tokens": [list(h.result(timeout=60).token_ids) for h in handles]}
    if scenario == "grammar":
        schema = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}},
                             "required": ["n"]})
        params = SamplingParams(max_tokens=24, temperature=0.0, constraint=schema)
        handles = [eng.submit(request_for(p, params)) for p in PROMPTS[:2]]
        return {"texts": [h.result(timeout=60).text for h in handles],
                "tokens": [list(h.result(timeout=60).token_ids) for h in handles]}
    if scenario == "cancel":
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        seen = threading.Event()
        count = [0]

        def on_token(token: int, text: str) -> bool:
            count[0] += 1
            if count[0] == 5:
                seen.set()
            return True

        siblings = [eng.submit(request_for(PROMPTS[0], long)),
                    eng.submit(request_for(PROMPTS[2], long))]
        victim = eng.submit(request_for(PROMPTS[1], long), on_token=on_token)
        seen.wait(60)
        victim.cancel()
        victim_result = victim.result(timeout=60)
        after = eng.submit(request_for(PROMPTS[3],
                                       greedy)).result(timeout=60)  # both ranks still agree
        return {"tokens": [list(h.result(timeout=60).token_ids) for h in siblings],
                "victim_reason": str(victim_result.finish_reason.value),
                "victim_tokens": len(victim_result.token_ids),
                "after": list(after.token_ids)}
    if scenario == "kill":
        # Decode until the harness has killed (or stopped) the follower: long rows, one
        # after another, until one of them fails.
        forever = SamplingParams(max_tokens=2040, temperature=0.0, ignore_eos=True)
        started, error, rows = 0.0, "", 0
        while not error and rows < 1000:
            handle = eng.submit(request_for(PROMPTS[0], forever))
            rows += 1
            try:
                if not started:
                    next(iter(handle))
                    started = time.monotonic()
                    print("DECODING", flush=True)  # the harness kills the follower now
                handle.result(timeout=120)
            except EngineDeadError as exc:
                error = f"EngineDeadError: {exc}"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        waited = time.monotonic() - started
        try:
            eng.submit(TextRequest("x", greedy))
            later = "accepted"
        except EngineDeadError:
            later = "EngineDeadError"
        return {"error": error, "seconds_after_decoding": waited, "later_submit": later,
                "rows": rows}
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> None:
    model, shard, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    config = EngineConfig(max_batch=8, prefill_chunk=64, shard=shard,  # type: ignore[arg-type]
                          distributed_timeout=timeout)
    rank = engine.distributed_rank()
    tokens: dict[int, list[int]] = {}
    if engine.follow(model, config, tokens=tokens):
        emit({"rank": rank, "followed": True, "tokens": sorted(tokens.values())})
        return
    eng = Engine(model, config).start(timeout=120)
    result = run_rank0(eng, scenario)
    eng.close()
    emit({"rank": rank, **result})


if __name__ == "__main__":
    main()
