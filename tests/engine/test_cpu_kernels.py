"""The CPU kernels inside the engine: the weight policy as stats() reports it, batched ==
alone with the kernels on, the fallback path with them off (MLX_PROVIDERS_CPU_KERNELS=0, as
on a machine where they could not be built), and the same greedy tokens as MLX's own ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine, TextRequest
from engine.device.kernels import cpu_kernels
from testkit.quantized_model import build_quantized_tiny_model
from tests.conftest import alone, greedy, prompts_of_lengths

ROOT = Path(__file__).resolve().parents[2]
STATUS = cpu_kernels.kernel_status()
needs_kernels = pytest.mark.skipif(not STATUS.available,
                                   reason=f"CPU kernels unavailable: {STATUS.reason}")
_build_lock = threading.Lock()


@pytest.fixture(scope="session")
def quantized_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 with 64-wide heads, quantized to 4 bits in groups of 32."""
    root = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    out = (Path(root) if root else tmp_path_factory.getbasetemp()) / "tiny-qwen2-q4g32-v1"
    with _build_lock:
        if not (out / "config.json").exists():
            partial = out.with_name(out.name + f".tmp{os.getpid()}")
            build_quantized_tiny_model(partial)
            os.replace(partial, out)
    return out


@needs_kernels
def test_a_quantized_model_runs_quantized_on_the_kernels(
        make_engine: Callable[..., Engine], quantized_model_dir: Path) -> None:
    stats = make_engine(quantized_model_dir).stats()
    assert stats.weight_format == "quantized 4-bit g32"
    assert stats.cpu_kernels.startswith(STATUS.describe())
    assert "matmul 15/15 quantized layers" in stats.cpu_kernels  # 2 layers x 7, the embedding
    assert "4 sibling groups in one call each" in stats.cpu_kernels  # q/k/v, gate/up a layer
    assert "decode attention" in stats.cpu_kernels
    assert "2 layers' decode step in two ops" in stats.cpu_kernels  # decode_layer
    assert "int8" not in stats.cpu_kernels  # only when asked for


@needs_kernels
def test_quantized_false_dequantizes_and_keeps_the_attention_kernel(
        make_engine: Callable[..., Engine], quantized_model_dir: Path) -> None:
    quantized = make_engine(quantized_model_dir).stats()
    dense = make_engine(quantized_model_dir, quantized=False).stats()
    assert dense.weight_format == "dequantized float32"
    assert dense.weights_bytes > 3 * quantized.weights_bytes  # 32 bits a weight, not ~6
    assert dense.cpu_kernels == f"{STATUS.describe()}: decode attention, RMSNorm and RoPE"


def test_a_float_model_reports_its_dtype(tiny_engine: Engine) -> None:
    stats = tiny_engine.stats()
    assert stats.weight_format == "float32"
    assert stats.cpu_kernels.startswith(STATUS.describe())


@needs_kernels
def test_batched_equals_alone_with_the_kernels(make_engine: Callable[..., Engine],
                                               quantized_model_dir: Path) -> None:
    eng = make_engine(quantized_model_dir, max_batch=16, prefill_chunk=64)
    prompts = prompts_of_lengths(eng, [3, 17, 64, 65, 130, 7, 250, 41], seed=21)
    params = greedy(32)
    reference = alone(eng, prompts, params)
    assert len(set(reference)) == len(prompts), "prompts should give distinct continuations"
    handles = [eng.submit(TextRequest(p, params)) for p in prompts]
    assert [h.result(timeout=120).token_ids for h in handles] == reference
    assert eng.stats().peak_running >= 6


@needs_kernels
def test_int8_activations_keep_batched_equal_to_alone(make_engine: Callable[..., Engine],
                                                      quantized_model_dir: Path) -> None:
    """cpu_int8 rounds activations (the tokens may differ from the float path's) but a row's
    tokens still never depend on the rows beside it; stats() says whether the path runs."""
    eng = make_engine(quantized_model_dir, max_batch=8, prefill_chunk=64, cpu_int8=True)
    path = cpu_kernels.int8_path()
    assert (f"int8 activations ({path})" in eng.stats().cpu_kernels) is bool(path)
    prompts = prompts_of_lengths(eng, [3, 17, 64, 130, 7, 41], seed=22)
    params = greedy(24)
    reference = alone(eng, prompts, params)
    handles = [eng.submit(TextRequest(p, params)) for p in prompts]
    assert [h.result(timeout=120).token_ids for h in handles] == reference
    assert eng.stats().peak_running >= 4


_REFERENCE_RUN = """
import json, sys
import engine
from engine import Engine, EngineConfig, SamplingParams, TextRequest
path, quantized, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
eng = Engine(path, EngineConfig(max_batch=16, prefill_chunk=64, quantized=quantized)).start()
params = SamplingParams(max_tokens=32, temperature=0.0)
alone = [list(eng.submit(TextRequest(p, params)).result().token_ids) for p in prompts]
batched = [list(h.result().token_ids)
           for h in [eng.submit(TextRequest(p, params)) for p in prompts]]
st = eng.stats()
print(json.dumps({"alone": alone, "batched": batched, "weight_format": st.weight_format,
                  "cpu_kernels": st.cpu_kernels}))
eng.close()
"""


def _without_kernels(model: Path, quantized: bool | None,
                     prompts: list[list[int]]) -> dict[str, object]:
    """The engine in a process where the kernels are switched off, as where they cannot build."""
    env = {**os.environ, cpu_kernels.ENV_SWITCH: "0"}
    run = subprocess.run([sys.executable, "-c", _REFERENCE_RUN, str(model),
                          json.dumps(quantized), json.dumps(prompts)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("quantized", "form"), [(None, "dequantized float32"),
                                                 (True, "quantized 4-bit g32")])
def test_without_the_kernels_the_policy_falls_back_to_mlx_ops(
        make_engine: Callable[..., Engine], quantized_model_dir: Path, quantized: bool | None,
        form: str) -> None:
    """Off (or unbuildable), a quantized model is dequantized when it fits (quantized=None)
    or kept on MLX's quantized ops (True); stats() says why, batched still equals alone, and
    the tokens are the kernels' own."""
    probe = make_engine(quantized_model_dir)
    prompts = prompts_of_lengths(probe, [5, 40, 90, 12], seed=8)
    off = _without_kernels(quantized_model_dir, quantized, prompts)
    assert off["cpu_kernels"] == f"off: {cpu_kernels.ENV_SWITCH}=0"
    assert off["weight_format"] == form
    assert off["batched"] == off["alone"]
    if STATUS.available:  # the kernels reorder float sums only: the same greedy tokens here
        assert [list(t) for t in alone(probe, prompts, greedy(32))] == off["alone"]


@pytest.mark.slow
@pytest.mark.real  # the real default model, twice: make test-real (CI)
@needs_kernels
def test_the_default_model_gives_mlx_ops_tokens_and_logits() -> None:
    """SmolLM2-135M Q4_1 on the kernels against the same weights dequantized to float32 on
    MLX's ops (exactly the values MLX's quantized ops multiply by; those take minutes on a CPU
    here): the kernels dequantize exactly and only sum in another order, so the logits
    differ by ~1e-4 (bounded here at 1e-3) and 48 greedy tokens are the same on each prompt."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.kernels.kernel_layers import install
    from engine.device.loading.weight_policy import dequantize_model
    from engine.models import model_path_for

    path = model_path_for(None, True)
    reference, tokenizer = load(str(path))
    assert dequantize_model(reference) == 211
    kernels, _ = load(str(path))
    assert install(kernels).kernel_layers == 211

    def decode(model: object, ids: list[int], n: int) -> list[int]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0, -1]  # type: ignore[operator]
        out: list[int] = []
        for _ in range(n):
            out.append(int(mx.argmax(logits).item()))
            logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]  # type: ignore[operator]
        return out

    for question in ("Write a short poem about the sea.", "What is the capital of France?",
                     "Tell me a joke about cats."):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        want = decode(reference, ids, 48)
        assert decode(kernels, ids, 48) == want, question
        forced = mx.array([ids + want])
        gap = mx.abs(reference(forced)[0] - kernels(forced)[0]).max().item()
        assert gap < 1e-3, (question, gap)
