"""One rank of the sharded matrix: ``python crossings_main.py MODEL SHARD MODE [TIMEOUT]``.

Started by tests/distributed/test_sharded_crossings.py with ``MLX_HOSTFILE`` and
``MLX_RANK`` set. Rank 0 runs a sharded engine with fast-forward, speculation and prefix
reuse asked for, and for every feature that is not an engine mode runs a row with it among
plain rows and alone; it prints one JSON line ``{"rank": 0, "features": {...}}``. The other
rank follows. MODE ``batch`` or ``serial`` (every row on the serial lane, as for caches that
cannot batch), either with ``+kv8`` after it: the engine keeps its KV in 8 bits
(``kv_bits``), or ``+f16``: in float16 (``kv_dtype``); then only ``KV_FEATURES`` run (each
launch costs ``make test`` seconds).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Mapping
from typing import Any

import engine
from engine import EngineConfig, UnsupportedCombinationError
from engine.compatibility import Feature, Kind, Status, verdict
from testkit.crossings import (
    BASE_CONFIG,
    Assets,
    draft_of,
    runs_serially,
    settled,
    start_engine,
)

SIBLINGS = ["Name a colour.", "Count to five."]
# Short: every step of a sharded engine waits on the other rank (prefix reuse is off there).
SYSTEM = "You answer questions about the weather."


def emit(payload: dict[str, object]) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


# The sharded kv_bits and kv_dtype pairs' rows: forced tokens and drafts rewound on
# quantized (float16) KV on both ranks, a row evicted from such a batch, and the plain rows
# beside each.
KV_FEATURES = (Feature.SCHEMA, Feature.CANCEL_DECODE)


def parse_mode(mode: str) -> tuple[str, dict[str, Any]]:
    """``batch``, ``serial`` or either with ``+kv8``/``+kv4`` or ``+f16``: the lane mode and
    the engine's KV settings (kv_bits in groups of 32, the kv_bits model's heads being 32
    wide; or kv_dtype float16), empty for neither."""
    lane, _, kv = mode.partition("+")
    if not kv:
        return lane, {}
    if kv == "f16":
        return lane, {"kv_dtype": "float16"}
    return lane, {"kv_bits": int(kv.removeprefix("kv")), "kv_group_size": 32}


def config_for(shard: str, timeout: float, kv: Mapping[str, Any] | None = None,
               ) -> dict[str, Any]:
    config = {**BASE_CONFIG, "fast_forward": True, "speculation": 4,
              "prefix_cache_bytes": 32 << 20, "shard": shard, "distributed_timeout": timeout}
    config.update(kv or {})
    return config


def row_features(kv: Mapping[str, Any]) -> list[Feature]:
    """The features a launch runs a row of: every one that is not an engine mode, or the
    few of ``KV_FEATURES`` on a kv_bits or kv_dtype engine."""
    if kv:
        return list(KV_FEATURES)
    return [f for f in Feature if f.kind is not Kind.ENGINE]


def run_rank0(model: str, config: dict[str, Any], shard: str) -> dict[str, Any]:
    from engine.models.embedding_model import resolve_embedding_model

    try:
        embedding = resolve_embedding_model()
    except Exception:  # offline without the wheel: no embeddings beside the rows
        embedding = None
    served = start_engine(model, config, embedding_model=embedding)  # type: ignore[arg-type]
    sharded = Feature(f"sharded_{shard}")
    assets = Assets(model, "/no/such/adapter", embedding)  # type: ignore[arg-type]
    plain = [draft_of((), assets, question=q, system=SYSTEM) for q in SIBLINGS]
    found: dict[str, Any] = {}
    kv = {k: config[k] for k in ("kv_bits", "kv_dtype") if config.get(k) is not None}
    for feature in row_features(kv):
        if feature is Feature.EMBEDDINGS and embedding is None:
            continue
        draft = draft_of({feature}, assets, system=SYSTEM)
        if verdict(feature, sharded).status is Status.REFUSED:
            try:
                served.engine.submit(draft.request())
                found[feature.value] = {"refused": None}
            except UnsupportedCombinationError as exc:
                found[feature.value] = {"refused": list(exc.features)}
            continue
        alone = served.alone(draft.to_the_end())
        siblings = [served.alone(p) for p in plain]
        outcomes = served.run([plain[0], draft, plain[1]])
        row = outcomes.pop(1)
        found[feature.value] = {
            "alone": list(alone.tokens), "row": list(row.tokens), "finish": row.finish,
            "error": row.error or alone.error, "siblings_unchanged": outcomes == siblings,
            "streamed": None if row.streamed is None else list(row.streamed),
            "left": dict(settled(served.engine))}
    try:  # keep_alive is refused by the engine mode itself
        served.engine.submit(draft_of((), assets, system=SYSTEM).request(), keep_alive=0)
        found["keep_alive"] = {"refused": None}
    except UnsupportedCombinationError as exc:
        found["keep_alive"] = {"refused": list(exc.features)}
    stats = served.engine.stats()
    kv_dtypes = sorted(served.kv_dtypes.seen) if served.kv_dtypes is not None else []
    served.engine.close()
    return {"features": found, "forced_tokens": stats.forced_tokens,
            "drafted_tokens": stats.drafted_tokens, "prefix_hits": stats.prefix_hits,
            "batch_mode": stats.batch_mode, "kv_bits": stats.kv_bits,
            "cache_kinds": list(stats.cache_kinds), "kv_dtypes": kv_dtypes}


def main() -> None:
    model, shard = sys.argv[1], sys.argv[2]
    mode, kv = parse_mode(sys.argv[3])
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    config = config_for(shard, timeout, kv)
    rank = engine.distributed_rank()
    # Both ranks load under the same rule: serial mode sends every row to the serial lane.
    with runs_serially("qwen2") if mode == "serial" else contextlib.nullcontext():
        if engine.follow(model, EngineConfig(**config)):
            emit({"rank": rank, "followed": True})
            return
        result = run_rank0(model, config, shard)
    emit({"rank": rank, **result})


if __name__ == "__main__":
    main()
