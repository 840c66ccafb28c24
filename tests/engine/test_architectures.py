"""Every text architecture mlx-lm ships loads through the engine and decodes exactly.

For each model type (tiny random weights, built in a fraction of a second by
``testkit.architectures``; wrappers with their language model under ``text_config``): each
prompt alone equals mlx-lm's own greedy ``stream_generate``, four rows batched equal each
alone, and cancelling one row leaves its siblings' tokens unchanged. Architectures whose
caches cannot batch run on the serial lane, still exact.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, FinishReason, TextRequest
from testkit import architectures as arch
from tests.conftest import greedy, wait_until

SKIPPED = {**arch.UNRUNNABLE, **arch.METAL_ONLY, **arch.CRASHES}
# The default run: the families users load most, every text_config wrapper, every cache
# kind, and the architectures whose rows the load-time probe sends to the serial lane.
# MLX_PROVIDERS_ALL_ARCHITECTURES=1 runs all of mlx-lm's (~3.5 min on 2 cores).
DEFAULT = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "smollm3",
    "ministral3",
    "olmo2",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gemma3n",
    "gemma4_text",
    "gemma4",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen2_vl",
    "qwen3_vl",
    "mistral3",
    "pixtral",
    "lfm2",
    "lfm2-vl",
    "granitemoehybrid",
    "nemotron_h",
    "mamba",
    "mamba2",
    "gpt_bigcode",
    "llama4",
    "deepseek_v3",
    "recurrent_gemma",
)
# Rows of these run one at a time on the serial lane (mlx-lm 0.32.2): the load-time probe
# finds their batched decode differs from their plain one, or the cache cannot merge.
KNOWN_SERIAL = {
    "gemma2": "its attention mask does not broadcast over a batch cache",
    "gpt_bigcode": "its positions read a batch cache's per-row offsets as one number",
    "llama4": "its chunked attention cache",
    "mamba": "its SSM runs over the left padding of a batched prefill",
    "nemotron_h": "its mamba2 layers run over the left padding",
    "jamba": "its mamba layers run over the left padding",
    "bailing_moe_linear": "its linear attention runs over the left padding",
    "olmo_hybrid": "its linear attention runs over the left padding",
    "longcat_flash_ngram": "its n-gram embedding reads the left padding",
    "afm7": "its kv-reuse layers decode differently in a batch",
}
ALL = os.environ.get("MLX_PROVIDERS_ALL_ARCHITECTURES") == "1"
TOKENS = 10
# 40 tokens pass the tiny sliding window (32): rotating caches wrap inside the test.
LENGTHS = (5, 40, 13, 22)
_lock = threading.Lock()


def _params() -> list[object]:
    marks = {}
    for name, reason in SKIPPED.items():
        marks[name] = pytest.mark.skip(reason=f"{name}: {reason}")
    names = arch.architectures() if ALL else [n for n in arch.architectures() if n in DEFAULT]
    return [pytest.param(name, marks=marks.get(name, ())) for name in names]


@pytest.fixture(scope="module")
def build_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    # Keyed by the builder's source: a changed config never reuses a stale model.
    key = hashlib.sha256(inspect.getsource(arch).encode()).hexdigest()[:12]
    base = Path(root) if root else tmp_path_factory.getbasetemp()
    return base / f"architectures-{key}"


def built(model_type: str, root: Path, tokenizer_dir: Path) -> Path:
    out = root / model_type
    with _lock:
        if not (out / "config.json").exists():
            vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
            partial = out.with_name(out.name + f".tmp{os.getpid()}")
            arch.build_architecture_model(model_type, partial, tokenizer_dir, vocab_size=vocab)
            os.replace(partial, out)
    return out


def prompts_for(vocab: int) -> list[list[int]]:
    # Fixed ids from the ordinary vocabulary (the tiny tokenizer's specials are below 10).
    return [[10 + (7 * i + 31 * n) % (vocab - 10) for i in range(n)] for n in LENGTHS]


def mlx_lm_greedy(model_dir: Path, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    """mlx-lm's own greedy decode of each prompt, the ground truth."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    eos = set(tokenizer.eos_token_ids)
    out = []
    for prompt in prompts:
        tokens: list[int] = []
        for step in stream_generate(
            model, tokenizer, prompt, max_tokens=TOKENS, sampler=make_sampler(0.0)
        ):
            if step.token in eos:
                break
            tokens.append(step.token)
        out.append(tuple(tokens))
    return out


@pytest.fixture
def engine_for(tiny_model_dir: Path, build_root: Path) -> Iterator[object]:
    engines: list[Engine] = []

    def factory(model_type: str) -> tuple[Engine, Path]:
        path = built(model_type, build_root, tiny_model_dir)
        eng = Engine(path, EngineConfig(max_batch=8, prefill_chunk=64)).start()
        engines.append(eng)
        return eng, path

    yield factory
    for eng in engines:
        eng.close()


@pytest.mark.parametrize("model_type", _params())
def test_architecture_loads_and_decodes_exactly(model_type: str, engine_for) -> None:  # type: ignore[no-untyped-def]
    eng, path = engine_for(model_type)
    mode = eng.stats().batch_mode
    if model_type in KNOWN_SERIAL:
        assert mode == "serial", f"{model_type}: {KNOWN_SERIAL[model_type]}, yet it batches"
    elif model_type in DEFAULT:
        assert mode == "batch", f"{model_type} was sent to the serial lane"
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab)
    expected = mlx_lm_greedy(path, prompts)
    params = greedy(TOKENS)

    alone = [eng.submit(TextRequest(p, params)).result(timeout=60).token_ids for p in prompts]
    assert alone == expected, f"{model_type}: the engine alone differs from mlx-lm"

    handles = [eng.submit(TextRequest(p, params)) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == expected

    # A long-running victim among three siblings, cancelled once it has decoded.
    seen: list[int] = []
    victim_params = greedy(400)
    handles = [eng.submit(TextRequest(p, params)) for p in prompts[:3]]
    victim = eng.submit(
        TextRequest(prompts[3], victim_params), on_token=lambda t, _: seen.append(t)
    )
    wait_until(lambda: len(seen) >= 2 or victim.done)
    victim.cancel()
    assert [h.result(timeout=60).token_ids for h in handles] == expected[:3]
    ended = victim.result(timeout=60)
    assert ended.finish_reason in (FinishReason.CANCELLED, FinishReason.STOP)
    assert ended.token_ids[:TOKENS] == expected[3][: len(ended.token_ids)]
