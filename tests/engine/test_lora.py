"""Many LoRA adapters on one base, in one batch (``SamplingParams.adapter``), on the tiny model
with adapters made by hand (testkit.adapters).

Rows with different adapters, and base rows, share the batch over one copy of the base
weights; each row's tokens equal it alone and mlx-lm's own generation with its adapter
(applied as LoRA layers, and fused). Prefixes are never shared across adapters; a bad
adapter fails its row alone; cancelling adapter rows leaves no slot held.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import (
    Engine,
    FinishReason,
    InvalidRequestError,
    JsonSchema,
    SamplingParams,
    TextRequest,
)
from testkit.adapters import make_adapter, mlx_lm_tokens
from tests.conftest import prompts_of_lengths, wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": str(make_adapter(root / "A", tiny_model_dir, seed=1)),
        "B": str(make_adapter(root / "B", tiny_model_dir, seed=2, rank=4,
                              keys=("self_attn.q_proj", "mlp.down_proj"))),
        "C": str(make_adapter(root / "C", tiny_model_dir, seed=3, layers=1)),
    }


def greedy(max_tokens: int = 16, adapter: str | None = None, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, adapter=adapter,
                          **kw)  # type: ignore[arg-type]


def run(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[int, ...]:
    return eng.submit(TextRequest(prompt, params)).result(timeout=60).token_ids


def test_rows_with_different_adapters_equal_alone_and_mlx_lm(
        make_engine: Callable[..., Engine], tiny_model_dir: Path,
        adapters: dict[str, str]) -> None:
    eng = make_engine(max_batch=8)
    prompts = prompts_of_lengths(eng, [40, 12, 70], seed=11)
    mix = [(p, a) for p in prompts for a in (None, "A", "B", "C")]
    alone = [run(eng, p, greedy(adapter=adapters.get(a or ""))) for p, a in mix]
    handles = [eng.submit(TextRequest(p, greedy(adapter=adapters.get(a or ""))))
               for p, a in random.Random(3).sample(mix, len(mix))]
    order = random.Random(3).sample(mix, len(mix))
    batched = {(tuple(p), a): h.result(timeout=60).token_ids for (p, a), h in zip(order, handles)}
    assert [batched[(tuple(p), a)] for p, a in mix] == alone
    assert len({alone[i] for i in range(4)}) == 4  # each adapter changes the output
    for (prompt, name), tokens in zip(mix[:4], alone[:4]):
        path = Path(adapters[name]) if name else None
        assert list(tokens) == mlx_lm_tokens(tiny_model_dir, path, prompt, 16)
        if path is not None:
            assert list(tokens) == mlx_lm_tokens(tiny_model_dir, path, prompt, 16, fused=True)


def test_prefixes_are_never_shared_across_adapters(
        make_engine: Callable[..., Engine], adapters: dict[str, str]) -> None:
    fresh = make_engine(prefix_cache_bytes=0)
    prompt = prompts_of_lengths(fresh, [120], seed=5)[0]
    expected = {a: run(fresh, prompt, greedy(adapter=adapters.get(a or "")))
                for a in (None, "A", "B")}
    eng = make_engine()
    for name in (None, "A", "B", "A", None, "B"):
        assert run(eng, prompt, greedy(adapter=adapters.get(name or ""))) == expected[name]
    assert eng.stats().prefix_hits >= 3  # each repeat resumed its own adapter's prefix


def test_constrained_and_forced_rows_with_adapters(
        make_engine: Callable[..., Engine], adapters: dict[str, str]) -> None:
    eng = make_engine(max_batch=8)
    schema = JsonSchema({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                          "days": {"enum": [1, 2, 3]}},
                         "required": ["city", "days"]})
    prompts = prompts_of_lengths(eng, [30, 50], seed=8)
    cases = [(p, a) for p in prompts for a in (None, "A", "B")]
    alone = [run(eng, p, greedy(40, adapter=adapters.get(a or ""), constraint=schema))
             for p, a in cases]
    handles = [eng.submit(TextRequest(p, greedy(40, adapter=adapters.get(a or ""),
                                                 constraint=schema))) for p, a in cases]
    assert [h.result(timeout=60).token_ids for h in handles] == alone
    text = eng.tokenizer.decode(list(alone[1]))
    assert json.loads(text)["city"] in ("Paris", "Rome")


def test_a_bad_adapter_fails_its_row_alone(make_engine: Callable[..., Engine],
                                           tmp_path: Path, tiny_model_dir: Path,
                                           adapters: dict[str, str]) -> None:
    eng = make_engine(max_batch=8)
    prompt = prompts_of_lengths(eng, [30], seed=2)[0]
    expected = run(eng, prompt, greedy())
    dora = Path(make_adapter(tmp_path / "dora", tiny_model_dir, seed=4))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    wrong = tmp_path / "wrong"
    make_adapter(wrong, tiny_model_dir, seed=5)
    import mlx.core as mx

    weights = mx.load(str(wrong / "adapters.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_a"))
    stray = make_adapter(tmp_path / "stray", tiny_model_dir, seed=6)
    stray_weights = dict(weights)
    stray_weights[key.replace("q_proj", "nope")] = stray_weights.pop(key)
    stray_weights[key.replace("q_proj", "nope").replace("lora_a", "lora_b")] = (
        stray_weights.pop(key.replace("lora_a", "lora_b")))
    mx.save_safetensors(str(stray / "adapters.safetensors"), stray_weights)
    weights[key] = mx.zeros((weights[key].shape[0] + 1, weights[key].shape[1]))
    mx.save_safetensors(str(wrong / "adapters.safetensors"), weights)
    # What the files say is refused at submit; whether the layers fit, when it loads.
    for path, why in ((str(tmp_path / "missing"), "no adapter_config.json"),
                      (str(dora), "'dora' is not served per row")):
        with pytest.raises(InvalidRequestError, match=why):
            eng.submit(TextRequest(prompt, greedy(adapter=path)))
    misfit = eng.submit(TextRequest(prompt, greedy(adapter=str(wrong))))
    lacking = eng.submit(TextRequest(prompt, greedy(adapter=str(stray))))
    good = eng.submit(TextRequest(prompt, greedy()))
    with_a = eng.submit(TextRequest(prompt, greedy(adapter=adapters["A"])))
    with pytest.raises(InvalidRequestError, match="do not fit the base layer"):
        misfit.result(timeout=60)
    with pytest.raises(InvalidRequestError, match=r"self_attn\.nope is not a layer"):
        lacking.result(timeout=60)
    assert good.result(timeout=60).token_ids == expected
    assert with_a.result(timeout=60).token_ids == run(eng, prompt, greedy(adapter=adapters["A"]))


def test_cancelling_adapter_rows_leaves_no_slot_held(
        make_engine: Callable[..., Engine], adapters: dict[str, str]) -> None:
    eng = make_engine(max_batch=6, prefill_chunk=16)
    rng = random.Random(9)
    prompts = prompts_of_lengths(eng, [rng.randrange(4, 90) for _ in range(24)], seed=12)
    names = [rng.choice([None, "A", "B", "C"]) for _ in prompts]
    keep = set(range(0, 24, 4))
    reference = {i: run(eng, prompts[i], greedy(20, adapter=adapters.get(names[i] or "")))
                 for i in keep}
    handles = [eng.submit(TextRequest(p, greedy(20, adapter=adapters.get(n or ""))))
               for p, n in zip(prompts, names)]
    for i, handle in enumerate(handles):
        if i not in keep:
            time.sleep(rng.random() * 0.01)
            handle.cancel()
    results = [h.result(timeout=60) for h in handles]
    assert {i: results[i].token_ids for i in keep} == reference
    assert any(r.finish_reason is FinishReason.CANCELLED for r in results)
    composition = eng._runtime.composition
    assert composition is not None
    lane_adapters = composition.built.lanes.batch.adapters
    assert lane_adapters is not None
    deadline = time.monotonic() + 10
    while lane_adapters.uid_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lane_adapters.uid_slots == {}
    assert all(a.users == 0 for a in lane_adapters._slots.values())
    stats = eng.stats()
    assert stats.adapters_loaded == 3 and stats.adapters_bytes == lane_adapters.nbytes > 0


def test_adapters_in_use_are_never_evicted(make_engine: Callable[..., Engine],
                                           adapters: dict[str, str]) -> None:
    from engine.device.adapters.row_adapters import read_adapter

    eng = make_engine(max_batch=4)
    prompt = prompts_of_lengths(eng, [20], seed=3)[0]
    run(eng, prompt, greedy(2))  # loaded
    composition = eng._runtime.composition
    assert composition is not None
    composition_model = composition.built.model.model
    one = read_adapter(Path(adapters["A"]), composition_model).nbytes
    small = make_engine(max_batch=4, adapter_bytes=one + one // 2)  # room for one adapter
    long = small.submit(TextRequest(prompt, greedy(400, adapter=adapters["A"],
                                                   ignore_eos=True)))
    while not long.done and small.stats().generated_tokens < 5:
        time.sleep(0.01)
    refused = small.submit(TextRequest(prompt, greedy(4, adapter=adapters["B"])))
    with pytest.raises(InvalidRequestError, match="do not fit in adapter_bytes"):
        refused.result(timeout=60)
    long.cancel()
    long.result(timeout=60)
    # A is idle now: B takes its room.
    assert len(run(small, prompt, greedy(4, adapter=adapters["B"]))) == 4


def test_seeded_adapter_rows_run_alone_with_their_adapter(
        make_engine: Callable[..., Engine], adapters: dict[str, str]) -> None:
    """A seeded row runs on the serial lane with its adapter's slot: at a temperature so
    low that sampling is the argmax it gives the greedy adapter row's tokens (which equal
    mlx-lm's), and it releases the adapter when it ends."""
    eng = make_engine()
    prompt = [1, 2, 3, 40, 50]
    greedy_row = run(eng, prompt, greedy(12, adapter=adapters["A"]))
    assert greedy_row != run(eng, prompt, greedy(12))
    cold = SamplingParams(max_tokens=12, temperature=1e-4, seed=1, adapter=adapters["A"])
    assert run(eng, prompt, cold) == greedy_row
    warm = SamplingParams(max_tokens=12, temperature=0.9, seed=2, adapter=adapters["B"])
    alone = run(eng, prompt, warm)
    handles = [eng.submit(TextRequest(prompt, greedy(12, adapter=adapters["A"]))),
               eng.submit(TextRequest(prompt, warm))]
    assert handles[0].result(timeout=60).token_ids == greedy_row
    assert handles[1].result(timeout=60).token_ids == alone
    wait_until(lambda: eng.stats().running == 0)
    assert eng.stats().adapters_in_use == 0
