"""The speed-ups on every kind of cache: sliding windows, hybrids, state-space models.

For each architecture of ``testkit.cache_kinds`` (tiny random weights, the test model's
tokenizer and chat template), an engine with every speed-up on is compared with one with
every speed-up off (no fast-forward, no speculation, no prefix store):

- grammar fast-forward forces tokens, with the same output;
- speculation drafts tokens the model accepts, with the same output, and rolls back
  rejected drafts exactly (checked with every row made to speculate);
- a second turn reads at least its first turn's prompt from the store, same output;
- batched rows equal the same rows alone, with every speed-up on.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, EngineConfig, JsonSchema, SamplingParams, StepProbe
from engine.device.speedups.speculation import speculate
from testkit.cache_kinds import CONFIGS, build_cache_kind_model
from testkit.speculating import every_draft_checked
from tests.conftest import greedy, prompts_of_lengths, request_for
from tests.engine.test_engine_tools import ASK, CLOCK
from tests.engine.test_fast_forward import NESTED
from tests.engine.test_logprobs import close
from tests.unit.test_tools import WEATHER

KINDS = list(CONFIGS)
# An array of enum values: one choice per item, the rest forced; prompt lookup predicts
# an item from the earlier ones, so drafts are accepted on any model, and rejected often.
ITEMS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
         "minItems": 20, "maxItems": 20}
SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(40))

_build_lock = threading.Lock()


@dataclass
class Pair:
    """One architecture with every speed-up on, and with every speed-up off."""

    model_type: str
    on: Engine
    off: Engine


@pytest.fixture(scope="session")
def cache_kind_dir(tiny_model_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Builds (once per session) a tiny model of a cache kind with the test tokenizer."""
    root = Path(os.environ.get("MLX_PROVIDERS_TEST_CACHE") or tmp_path_factory.getbasetemp())
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]

    def build(model_type: str) -> Path:
        out = root / f"tiny-{model_type}-v1"
        with _build_lock:
            if not (out / "config.json").exists():
                partial = out.with_name(out.name + f".tmp{os.getpid()}")
                build_cache_kind_model(model_type, partial, tiny_model_dir, vocab_size=vocab)
                os.replace(partial, out)
        return out

    return build


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest,
         cache_kind_dir: Callable[[str], Path]) -> Iterator[Pair]:
    path = cache_kind_dir(request.param)
    on = Engine(path, EngineConfig(max_batch=8, prefill_chunk=64, speculation=4)).start()
    off = Engine(path, EngineConfig(max_batch=8, prefill_chunk=64, fast_forward=False,
                                    speculation=0, prefix_cache_bytes=0)).start()
    yield Pair(request.param, on, off)
    on.close()
    off.close()


def tokens(eng: Engine, prompt: Any, params: SamplingParams, **kw: Any) -> tuple[int, ...]:
    return eng.submit(request_for(prompt, params, **kw)).result(timeout=120).token_ids


_references: dict[tuple[str, str], tuple[int, ...]] = {}


def reference(pair: Pair, prompt: Any, params: SamplingParams, **kw: Any) -> tuple[int, ...]:
    """The tokens of the engine with every speed-up off, decoded once per architecture and
    request: it is greedy with nothing carried between requests, so a second run of the same
    request only repeats the first (the tests ask for the same few requests many times)."""
    key = (str(pair.off.model_path), repr((prompt, params, kw)))
    if key not in _references:
        _references[key] = tokens(pair.off, prompt, params, **kw)
    return _references[key]


FORCED = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False}


def test_fast_forward_forces_tokens_with_the_same_output(pair: Pair) -> None:
    before = pair.on.stats().forced_tokens
    for prompt, params, kw in [(ASK, greedy(80), FORCED),
                               ("plan", greedy(120, constraint=JsonSchema(NESTED)), {})]:
        assert tokens(pair.on, prompt, params, **kw) == reference(pair, prompt, params, **kw)
    assert pair.on.stats().forced_tokens > before
    assert pair.off.stats().forced_tokens == 0


def test_speculation_drafts_tokens_with_the_same_output(pair: Pair) -> None:
    before = pair.on.stats().drafted_tokens
    for prompt in ("list", "pick some", "names:", "choose"):
        params = greedy(120, constraint=JsonSchema(ITEMS))
        assert tokens(pair.on, prompt, params) == reference(pair, prompt, params)
    assert pair.on.stats().drafted_tokens > before
    assert pair.off.stats().drafted_tokens == 0


def test_rejected_drafts_roll_back_exactly(pair: Pair) -> None:
    # Every row with a draft speculates, whatever its drafts' record: most drafts of a
    # random model are rejected, so this is the rollback path on every step.
    checks = [0]

    def counted(*args: Any) -> Any:
        checks[0] += 1
        return speculate(*args)

    with Engine(pair.on.model_path, pair.on.config,
                probe=StepProbe(on_lanes=every_draft_checked(counted))).start() as on:
        _rejected_drafts_roll_back(Pair(pair.model_type, on, pair.off), checks)


def _rejected_drafts_roll_back(pair: Pair, checks: list[int]) -> None:
    base = prompts_of_lengths(pair.on, [6, 6, 6], seed=3)
    prompts = [part * 4 for part in base]  # repeated n-grams: a draft from the first step
    prompts.append([{"role": "user", "content": "say it again and again"}])
    for prompt in prompts:
        params = greedy(40, ignore_eos=True)
        assert tokens(pair.on, prompt, params) == reference(pair, prompt, params)
    array = greedy(120, constraint=JsonSchema(ITEMS))
    assert tokens(pair.on, "list", array) == reference(pair, "list", array)
    assert checks[0] > 0


def test_logprobs_are_those_of_decoding_with_every_speed_up_on(pair: Pair) -> None:
    # Every drafting row checks (rejected drafts trimmed or rolled back); a state cache's
    # row enters speculation with the token the batch already chose, and its logprob.
    with Engine(pair.on.model_path, pair.on.config,
                probe=StepProbe(on_lanes=every_draft_checked())).start() as on:
        _logprobs_as_decoding(Pair(pair.model_type, on, pair.off))


def _logprobs_as_decoding(pair: Pair) -> None:
    before = pair.on.stats().drafted_tokens
    repeated = [*(part * 4 for part in prompts_of_lengths(pair.on, [6, 6], seed=3)),
                *([token] * 16 for token in prompts_of_lengths(pair.on, [6], seed=1)[0])]
    asks: list[tuple[Any, SamplingParams]] = [
        *((prompt, greedy(40, ignore_eos=True, logprobs=True, top_logprobs=2))
          for prompt in repeated),
        ("list", greedy(120, constraint=JsonSchema(ITEMS), logprobs=True, top_logprobs=2))]
    for prompt, params in asks:
        fast = pair.on.submit(request_for(prompt, params)).result(timeout=120)
        slow = pair.off.submit(request_for(prompt, params)).result(timeout=120)
        assert fast.token_ids == slow.token_ids
        close(fast.logprobs, slow.logprobs)
    assert pair.on.stats().drafted_tokens > before


def test_a_second_turn_reads_the_first_turns_prompt_from_the_store(pair: Pair) -> None:
    first_turn = [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": f"Question for {pair.model_type}: what now?"}]
    first = pair.on.submit(request_for(first_turn, greedy(12))).result(timeout=120)
    second_turn = [*first_turn, {"role": "assistant", "content": first.text},
                   {"role": "user", "content": "And then?"}]
    second = pair.on.submit(request_for(second_turn, greedy(12))).result(timeout=120)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert first.token_ids == reference(pair, first_turn, greedy(12))
    assert second.token_ids == reference(pair, second_turn, greedy(12))


def test_batched_equals_alone_with_every_speed_up_on(pair: Pair) -> None:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go on."}]
    repeated = prompts_of_lengths(pair.on, [5], seed=7)[0] * 5
    requests: list[tuple[Any, SamplingParams, dict[str, Any]]] = [
        (ASK, greedy(80), FORCED),
        ("list", greedy(120, constraint=JsonSchema(ITEMS)), {}),
        (chat, greedy(24), {}),
        (repeated, greedy(30, ignore_eos=True), {}),
        ("plan", greedy(120, constraint=JsonSchema(NESTED)), {}),
        ("free text", greedy(30), {}),
    ]
    alone = [tokens(pair.on, p, params, **kw) for p, params, kw in requests]
    assert alone == [reference(pair, p, params, **kw) for p, params, kw in requests]
    for order in (requests, requests[::-1]):
        handles = [pair.on.submit(request_for(p, params, **kw)) for p, params, kw in order]
        got = [h.result(timeout=120).token_ids for h in handles]
        assert got == (alone if order is requests else alone[::-1])
    assert pair.on.stats().peak_running >= 4


def test_stats_say_what_each_speed_up_does_on_these_caches(pair: Pair) -> None:
    stats = pair.on.stats()
    found = {s.name: s for s in stats.speedups}
    assert set(found) == {"fast_forward", "speculation", "prefix_reuse", "prefix_disk"}
    assert found["fast_forward"].on and found["speculation"].on and found["prefix_reuse"].on
    kinds = set(stats.cache_kinds)
    assert kinds - {"KVCache"}, kinds  # every architecture here has more than plain KV
    if "ArraysCache" in kinds:
        assert "rolled back" in found["speculation"].detail
        assert "state caches resumed exactly" in found["prefix_reuse"].detail
    if "RotatingKVCache" in kinds:
        assert "sliding windows" in found["prefix_reuse"].detail
    off = {s.name: s for s in pair.off.stats().speedups}
    assert not any(s.on for s in off.values())
    assert off["fast_forward"].detail == "off: fast_forward=False"
    assert off["prefix_reuse"].detail == "off: prefix_cache_bytes=0"


def test_stats_say_why_caches_that_cannot_merge_get_no_speed_ups(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import QuantizedKVCache

    monkeypatch.setattr(qwen2.Model, "make_cache", lambda self: [
        QuantizedKVCache(group_size=32, bits=8) for _ in self.layers], raising=False)
    stats = make_engine().stats()
    found = {s.name: s for s in stats.speedups}
    assert stats.cache_kinds == ("QuantizedKVCache",) and stats.batch_mode == "serial"
    assert found["fast_forward"].on  # the serial lane feeds forced tokens with the sampled one
    assert not found["speculation"].on and "QuantizedKVCache" in found["speculation"].detail
    assert not found["prefix_reuse"].on and "QuantizedKVCache" in found["prefix_reuse"].detail


def test_a_restart_reads_the_head_back_from_disk(pair: Pair, tmp_path: Path) -> None:
    def asked(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    path = pair.on.model_path
    with Engine(path, EngineConfig(prefix_cache_dir=str(tmp_path))) as first:
        first.submit(request_for(asked("First?"), greedy(8))).result(timeout=120)
    with Engine(path, EngineConfig(prefix_cache_dir=str(tmp_path))) as restarted:
        second = restarted.submit(request_for(asked("Second?"), greedy(8))).result(timeout=120)
        stats = restarted.stats()
    assert stats.prefix_disk_hits == 1 and second.usage.cached_tokens > 40
    assert second.token_ids == reference(pair, asked("Second?"), greedy(8))
