"""Many LoRA adapters in one batch against base rows, and against one engine per adapter.

On the default model (SmolLM2-135M-Instruct, as the engine loads it here), with adapters
made by hand (``testkit.adapters``): rank 8 on every layer's q and v projections, unless a
case says otherwise. Sixteen rows decode ``--tokens`` tokens each, in one batch:

- all on the base model (the baseline), with adapters loaded but unused too;
- all with one adapter, with 4 distinct adapters (4 rows each), with 16 (1 each);
- 8 base rows beside 8 rows of one adapter;
- 4 adapters of mixed ranks (two rank 8, two rank 64), 4 rows each;
- adapters in mlx-lm's default shape (``mlx_lm.lora``: rank 8, scale 20, every linear of
  the last 16 blocks): one adapter on 16 rows, and 4 adapters x 4 rows;
- and the way an MLX user serves adapters today: one engine per fused adapter (mlx-lm's
  ``fuse``), each running its rows, one after another (load time reported apart).

It prints tokens/s per case and its ratio to the base rows, the one-engine-per-adapter
ratio, and memory: the base weights plus the adapters, against a fused copy per adapter.

    python bench/adapters.py [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig, SamplingParams, TextRequest, blas_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for testkit.adapters
from testkit.adapters import make_adapter

ROWS = 16


# mlx-lm's default LoRA shape (``mlx_lm.lora``'s defaults): every linear of a block.
EVERY_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def adapters_for(model: Path, count: int, *, rank: int = 8, scale: float = 2.0,
                 keys: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj"),
                 layers: int | None = None, tag: str = "r8") -> list[str]:
    """``count`` adapters of one shape, made once and kept in the user cache."""
    root = Path.home() / ".cache" / "mlx-providers" / "bench" / f"adapters-{model.name}"
    paths = []
    for k in range(count):
        out = root / f"{tag}-{k}"
        if not (out / "adapters.safetensors").exists():
            make_adapter(out, model, seed=100 + k, rank=rank, scale=scale, keys=keys,
                         layers=layers)
        paths.append(str(out))
    return paths


def fused_copy(model: Path, adapter: str) -> Path:
    """The base with the adapter fused in (mlx-lm's LoRA layers, then ``fuse``), saved."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model, save_config, save_model

    out = Path(adapter).with_name(Path(adapter).name + "-fused")
    if (out / "config.json").exists():
        return out
    base, config = load_model(model)
    base = load_adapters(base, adapter)
    fused = [(n, m.fuse()) for n, m in base.named_modules() if hasattr(m, "fuse")]
    base.update_modules(tree_unflatten(fused))
    mx.eval(base.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, base)
    save_config(config, out / "config.json")
    for item in model.iterdir():
        if item.name.startswith("tokenizer") or item.name in ("generation_config.json",
                                                               "special_tokens_map.json"):
            shutil.copy(item, out / item.name)
    return out


def run_rows(eng: Engine, prompts: list[list[int]], adapters: list[str | None],
             tokens: int) -> float:
    """Seconds for every row to finish, all submitted at once."""
    started = time.perf_counter()
    handles = [eng.submit(TextRequest(tuple(p), SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True, adapter=a)))
        for p, a in zip(prompts, adapters)]
    for handle in handles:
        handle.result(timeout=600)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    eng = Engine(None, EngineConfig(max_batch=ROWS, speculation=0)).start()
    model = eng.model_path
    adapters = adapters_for(model, ROWS)
    mixed = adapters[:2] + adapters_for(model, 2, rank=64, tag="r64")
    default_shape = adapters_for(model, 4, scale=20.0, keys=EVERY_LINEAR, layers=16,
                                 tag="mlx-lm-default")
    tokenizer = eng.tokenizer
    prompts = [tokenizer.encode(f"Write a short note about topic {k}: rivers, salt and "
                                f"clocks, number {k}.") for k in range(ROWS)]
    total = ROWS * args.tokens
    cases: dict[str, list[str | None]] = {
        "16 base rows": [None] * ROWS,
        "1 adapter x 16 rows": [adapters[0]] * ROWS,
        "8 base rows + 1 adapter x 8 rows": [None, adapters[0]] * (ROWS // 2),
        "4 adapters x 4 rows": [adapters[k % 4] for k in range(ROWS)],
        "16 adapters x 1 row": list(adapters[:ROWS]),
        "4 adapters, ranks 8 and 64, x 4 rows": [mixed[k % 4] for k in range(ROWS)],
        "1 mlx-lm default-shape adapter x 16 rows": [default_shape[0]] * ROWS,
        "4 mlx-lm default-shape adapters x 4 rows": [default_shape[k % 4]
                                                     for k in range(ROWS)],
    }
    run_rows(eng, prompts, [None] * ROWS, 4)  # warm-up: shapes
    for path in adapters:  # every adapter loaded once before timing
        run_rows(eng, prompts[:1], [path], 1)
    stats = eng.stats()  # the 16 rank-8 adapters alone
    weights, adapter_bytes = stats.weights_bytes, stats.adapters_bytes
    for path in mixed[2:] + default_shape:
        run_rows(eng, prompts[:1], [path], 1)
    held, held_bytes = eng.stats().adapters_loaded, eng.stats().adapters_bytes
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, chosen in cases.items():
            seconds[name].append(run_rows(eng, prompts, chosen, args.tokens))
    eng.close()
    # One engine per fused adapter, one after another: 4 adapters, their 4 rows each.
    per_engine: list[float] = []
    loads: list[float] = []
    for k in range(4):
        fused = fused_copy(model, adapters[k])
        started = time.perf_counter()
        single = Engine(fused, EngineConfig(max_batch=ROWS, speculation=0)).start()
        run_rows(single, prompts[:1], [None], 1)
        loads.append(time.perf_counter() - started)
        per_engine.append(run_rows(single, prompts[k::4], [None] * 4, args.tokens))
        single.close()
    # Base rows on an engine that never loaded an adapter (no layer wrapped).
    plain = Engine(None, EngineConfig(max_batch=ROWS, speculation=0)).start()
    run_rows(plain, prompts[:4], [None] * 4, 4)
    never = [run_rows(plain, prompts, [None] * ROWS, args.tokens) for _ in range(args.repeats)]
    plain.close()
    base_rate = total / statistics.median(seconds["16 base rows"])
    print(f"model: {model.name}; {args.tokens} tokens a row; {blas_info().name}")
    print()
    print("| rows | tok/s | vs 16 base rows |")
    print("|---|---:|---:|")
    rate = total / statistics.median(never)
    print(f"| 16 base rows, no adapter ever loaded | {rate:.1f} | {rate / base_rate:.2f} |")
    for name in cases:
        rate = total / statistics.median(seconds[name])
        print(f"| {name} | {rate:.1f} | {rate / base_rate:.2f} |")
    sequential = total / sum(per_engine)
    four = total / statistics.median(seconds["4 adapters x 4 rows"])
    print(f"| one engine per fused adapter, 4 in turn (loads {sum(loads):.1f} s apart) | "
          f"{sequential:.1f} | {sequential / base_rate:.2f} |")
    print()
    print(f"4 adapters in one batch vs one engine per adapter: {four / sequential:.2f}x "
          f"({four / (total / (sum(per_engine) + sum(loads))):.2f}x counting the loads)")
    print(f"memory: base weights {weights / 2**20:.1f} MiB + {ROWS} adapters "
          f"{adapter_bytes / 2**20:.1f} MiB = {(weights + adapter_bytes) / 2**20:.1f} MiB; "
          f"a fused copy per adapter: {ROWS} x {weights / 2**20:.1f} = "
          f"{ROWS * weights / 2**20:.1f} MiB")
    print(f"adapters held while timing: {held}, {held_bytes / 2**20:.1f} MiB "
          "(16 rank-8 on q and v, 2 rank-64 on q and v, 4 in mlx-lm's default shape)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
