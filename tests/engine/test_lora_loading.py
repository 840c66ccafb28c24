"""Loading LoRA adapters (``engine.device.adapters.row_adapters``): a bad adapter changes nothing,
what is held is counted, and each way a forward adds deltas equals mlx-lm's own LoRA layer.

An adapter whose layers are not linear, or whose config's rank understates its weights, fails
its own row and leaves every other adapter, slot, stack and wrapped layer exactly as it was;
``adapter_bytes`` counts the stacked pairs the engine holds (their only copy, no padding).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, InvalidRequestError, SamplingParams, TextRequest
from engine.device.adapters.row_adapters import RowAdapters, RowLoRALinear
from testkit.adapters import make_adapter, write_adapter
from tests.conftest import prompts_of_lengths

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": str(make_adapter(root / "A", tiny_model_dir, seed=1)),
        "B": str(make_adapter(root / "B", tiny_model_dir, seed=2, rank=4,
                              keys=("self_attn.q_proj", "mlp.down_proj"))),
        "C": str(make_adapter(root / "C", tiny_model_dir, seed=3, layers=1)),
        "D": str(make_adapter(root / "D", tiny_model_dir, seed=4, scale=3.0)),
    }


def greedy(max_tokens: int = 16, adapter: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, adapter=adapter)


def run(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[int, ...]:
    return eng.submit(TextRequest(tuple(prompt), params)).result(timeout=60).token_ids


def lane_adapters(eng: Engine) -> RowAdapters:
    composition = eng._runtime.composition
    assert composition is not None
    found = composition.built.lanes.batch.adapters
    assert found is not None
    return found


def state(adapters: RowAdapters) -> tuple[object, ...]:
    """What a load may change: names (rows reorder their LRU), slots, every stacked array,
    every wrapped layer."""
    wrapped = sorted(n for n, m in adapters.model.named_modules()
                     if isinstance(m, RowLoRALinear))
    stacks = {p: [(id(g.a), id(g.b), g.members.slots) for g in groups]
              for p, groups in adapters.stacks.items()}
    return sorted(adapters.names()), list(adapters._order), stacks, wrapped, adapters.nbytes


def test_an_adapter_on_a_layer_that_is_not_linear_is_refused_and_changes_nothing(
        make_engine: Callable[..., Engine], tmp_path: Path, adapters: dict[str, str]) -> None:
    import mlx.core as mx

    eng = make_engine(max_batch=8)
    prompt = prompts_of_lengths(eng, [30], seed=4)[0]
    expected = run(eng, prompt, greedy())
    expected_a = run(eng, prompt, greedy(adapter=adapters["A"]))
    before = state(lane_adapters(eng))
    # The tied token embedding (vocab, hidden) passes a linear's shape check.
    vocab, hidden = 2112, 64
    embed = write_adapter(tmp_path / "embed", {
        "model.embed_tokens.lora_a": mx.random.normal((hidden, 8)),
        "model.embed_tokens.lora_b": mx.random.normal((8, vocab))}, rank=8)
    bad = eng.submit(TextRequest(tuple(prompt), greedy(adapter=str(embed))))
    beside = [eng.submit(TextRequest(tuple(prompt), greedy(adapter=a)))
              for a in (None, adapters["A"])]
    with pytest.raises(InvalidRequestError,
                       match=r"model\.embed_tokens is a Embedding, not a linear") as refused:
        bad.result(timeout=60)
    assert refused.value.field == "adapter"
    assert [h.result(timeout=60).token_ids for h in beside] == [expected, expected_a]
    assert state(lane_adapters(eng)) == before
    for _ in range(2):  # later rows, base and adapter alike, as before
        assert run(eng, prompt, greedy()) == expected
        assert run(eng, prompt, greedy(adapter=adapters["A"])) == expected_a


def test_a_rank_that_understates_the_weights_is_refused_and_others_keep_theirs(
        make_engine: Callable[..., Engine], tmp_path: Path, tiny_model_dir: Path,
        adapters: dict[str, str]) -> None:
    eng = make_engine(max_batch=8)
    prompts = prompts_of_lengths(eng, [30, 55], seed=6)
    with_a = [run(eng, p, greedy(adapter=adapters["A"])) for p in prompts]
    with_b = [run(eng, p, greedy(adapter=adapters["B"])) for p in prompts]
    # Rank 8 weights under a config that says 4 (mlx-lm refuses such a directory too).
    understated = make_adapter(tmp_path / "understated", tiny_model_dir, seed=9)
    config = json.loads((understated / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 4
    (understated / "adapter_config.json").write_text(json.dumps(config))
    before = state(lane_adapters(eng))
    bad = eng.submit(TextRequest(tuple(prompts[0]), greedy(adapter=str(understated))))
    rows = [eng.submit(TextRequest(tuple(p), greedy(adapter=adapters[a]))) for p in prompts
            for a in ("A", "B")]
    with pytest.raises(InvalidRequestError, match=r"rank 8 .* says rank 4") as refused:
        bad.result(timeout=60)
    assert refused.value.field == "adapter"
    assert [h.result(timeout=60).token_ids for h in rows] == [
        t for pair in zip(with_a, with_b) for t in pair]
    assert [run(eng, p, greedy(adapter=adapters["A"])) for p in prompts] == with_a
    assert state(lane_adapters(eng)) == before
    stats = eng.stats()
    assert stats.adapters_loaded == 2 and stats.adapters_bytes == before[-1]


@pytest.mark.parametrize("lora", [{"rank": 0, "scale": 2.0}, {"rank": "8", "scale": 2.0},
                                  {"rank": True, "scale": 2.0}, {"rank": 8, "scale": "x"},
                                  {"rank": 8, "scale": float("inf")}])
def test_a_config_whose_rank_or_scale_is_not_a_number_is_refused_at_submit(
        tiny_engine: Engine, tmp_path: Path, tiny_model_dir: Path,
        lora: dict[str, object]) -> None:
    adapter = make_adapter(tmp_path / "odd", tiny_model_dir, seed=10)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                             "lora_parameters": lora}))
    field = "rank" if lora["rank"] != 8 else "scale"
    with pytest.raises(InvalidRequestError, match=f"lora_parameters' {field}"):
        tiny_engine.submit(TextRequest((1, 2, 3), greedy(adapter=str(adapter))))


# On the model itself, without an engine: what is held, and each way deltas are added.


def fresh_model(model_dir: Path) -> Any:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    loaded = load_model(model_dir)[0]
    mx.eval(loaded.parameters())
    return loaded


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    return fresh_model(tiny_model_dir)


def test_adapter_bytes_count_what_the_stacks_hold(model: Any, adapters: dict[str, str],
                                                  tiny_model_dir: Path) -> None:
    import mlx.core as mx

    from engine.device.adapters.row_adapters import attach, read_adapter

    held = attach(model, 1 << 30)
    own = sum(read_adapter(Path(adapters[n]), model).nbytes for n in "ABC")
    gc.collect()
    before = mx.get_active_memory()
    for name in "ABC":  # ranks 8, 4 and 8, on different layers
        held.acquire(adapters[name])
    gc.collect()
    grown = mx.get_active_memory() - before
    stacked = sum(int(g.a.nbytes + g.b.nbytes) for groups in held.stacks.values()
                  for g in groups)
    assert held.nbytes == stacked == own  # no padding to the largest rank, no zero slot
    # No second copy of the pairs (that would double it); a few small index arrays may come
    # with the first load (3 KiB of 35 KiB measured on one CI run).
    assert 0.95 * stacked <= grown < 1.5 * stacked
    # The LRU's room is the same count: room for A and B leaves C out, and A goes first.
    small = attach(fresh_model(tiny_model_dir), own - 1)
    for name in "ABC":
        small.acquire(adapters[name])
        small.release(str(Path(adapters[name]).resolve()))
    assert small.names() == [str(Path(adapters[n]).resolve()) for n in "BC"]
    assert small.nbytes <= own - 1


def test_a_load_that_fails_half_way_changes_nothing(
        model: Any, adapters: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.device.adapters import row_adapters

    held = row_adapters.attach(model, 1 << 30)
    held.acquire(adapters["A"])
    before = state(held)
    made = 0
    real = row_adapters._group

    def failing(*args: Any) -> Any:
        nonlocal made
        made += 1
        if made == 3:
            raise MemoryError("out of memory while stacking")
        return real(*args)

    monkeypatch.setattr(row_adapters, "_group", failing)
    with pytest.raises(MemoryError):
        held.acquire(adapters["B"])  # a new layer (down_proj) and a new rank on q_proj
    assert state(held) == before
    monkeypatch.setattr(row_adapters, "_group", real)
    assert held.acquire(adapters["B"])[1] == 2


def test_each_way_a_forward_adds_deltas_equals_mlx_lm_lora(
        model: Any, adapters: dict[str, str]) -> None:
    """One adapter on all rows, one on some rows, several (one gathered product), several
    ranks on one layer: each row bit for bit mlx-lm's ``LoRALinear`` with its adapter, and
    base rows exactly the base layer's."""
    import mlx.core as mx
    from mlx_lm.tuner.lora import LoRALinear

    from engine.device.adapters.row_adapters import attach

    held = attach(model, 1 << 30)
    slots = {n: held.acquire(adapters[n])[1] for n in "ABD"}
    path = "model.layers.1.self_attn.q_proj"  # A and D at rank 8, B at rank 4
    layer = dict(model.named_modules())[path]
    assert isinstance(layer, RowLoRALinear)
    references = {}
    for name in "ABD":
        pairs = mx.load(str(Path(adapters[name]) / "adapters.safetensors"))
        assert isinstance(pairs, dict)
        config = json.loads((Path(adapters[name]) / "adapter_config.json").read_text())
        lora = LoRALinear.from_base(layer.base, r=config["lora_parameters"]["rank"],
                                    scale=config["lora_parameters"]["scale"])
        lora.lora_a, lora.lora_b = pairs[f"{path}.lora_a"], pairs[f"{path}.lora_b"]
        references[slots[name]] = lora
    references[0] = layer.base
    mx.random.seed(5)
    for names in (["A"] * 3, [None, "A", None, None], ["A", "D", None, "D"],
                  ["B", "A", None, "D", "B"], ["B"]):
        row_slots = [slots[n] if n else 0 for n in names]
        x = mx.random.normal((len(names), 7, 64))
        with held.rows(row_slots):
            out = layer(x)
        # mlx-lm's layer on the whole batch: a base product's rounding may depend on how
        # many rows the BLAS call holds, so each row is compared at the same batch.
        for i, slot in enumerate(row_slots):
            assert mx.array_equal(out[i], references[slot](x)[i]), (names, i)
