"""keep_alive: an idle engine unloads its chat model and the next request loads it again.

Every wait here is bounded polling on ``stats()`` or a probe's hook; no test asserts a
time. The probe's ``on_model`` hook holds a load or an unload on the engine thread, so a
test can submit or cancel while it is under way.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, EngineConfig, FinishReason, Regex, StepProbe, TextRequest
from tests.conftest import Turns, greedy, request_for, wait_until

PROMPTS = [f"question {i}: " + "tell me more " * (3 + i) for i in range(8)]


class HeldStage:
    """A probe's ``on_model`` hook: once armed for a stage ("loading", "unloading"), the
    engine thread waits there for ``go`` (the test submits or cancels meanwhile)."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.reached, self.go = threading.Event(), threading.Event()
        self.stages: list[str] = []

    def __call__(self, stage: str) -> None:
        self.stages.append(stage)
        if stage == self.armed:
            self.armed = None
            self.reached.set()
            assert self.go.wait(30)

    def hold(self, stage: str) -> None:
        self.reached.clear()
        self.go.clear()
        self.armed = stage


def unloaded(eng: Engine, times: int = 1) -> None:
    """Wait until ``eng`` has unloaded its model ``times`` times and is still unloaded."""
    wait_until(lambda: eng.stats().unloads >= times and not eng.stats().loaded)


def run(eng: Engine, prompt: object, max_tokens: int = 12, **submit: object) -> tuple[int, ...]:
    return eng.submit(request_for(prompt, greedy(max_tokens)),  # type: ignore[arg-type]
                      **submit).result(timeout=60).token_ids


def test_an_idle_model_is_released_and_reloads_to_the_same_tokens(
        make_engine: Callable[..., Engine], tiny_model_dir: Path) -> None:
    eng = make_engine(keep_alive=0)
    unloaded(eng)  # start() loaded it; idle at once, it went
    before = run(eng, PROMPTS[0], keep_alive=None)  # loads it again, and keeps it
    loaded = eng.stats()
    assert (loaded.loaded, loaded.loads, loaded.unloads) == (True, 2, 1)
    assert run(eng, PROMPTS[0]) == before  # keep_alive 0 again: it unloads after this one
    unloaded(eng, 2)
    idle = eng.stats()
    assert (idle.loaded, idle.loads, idle.unloads) == (False, 2, 2)
    # The weights' arrays are gone, as MLX's allocator counts them on the engine thread,
    # and so are the in-memory prefix store (its KV) and MLX's cache of freed buffers.
    weights = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert loaded.mlx_active_bytes >= 0.95 * weights
    assert idle.mlx_active_bytes <= loaded.mlx_active_bytes - 0.95 * weights
    assert idle.prefix_entries == 0 and idle.prefix_bytes == 0 and idle.mlx_cache_bytes == 0
    assert run(eng, PROMPTS[0]) == before
    stats = eng.stats()
    assert (stats.loads, stats.completed, stats.failed) == (3, 3, 0)
    assert stats.last_load_seconds > 0


def test_without_keep_alive_the_model_stays_loaded(make_engine: Callable[..., Engine]) -> None:
    forever = make_engine()  # keep_alive=None, the default
    asked_forever = make_engine(keep_alive=0)
    quick = make_engine(keep_alive=0)
    unloaded(asked_forever)
    unloaded(quick)
    run(forever, PROMPTS[0])
    run(asked_forever, PROMPTS[0], keep_alive=None)  # this request overrides the config
    run(quick, PROMPTS[0])
    unloaded(quick, 2)  # by now the other two had as long to unload, and did not
    assert [(e.stats().loaded, e.stats().unloads) for e in (forever, asked_forever)] == [
        (True, 0), (True, 1)]


def test_a_request_with_keep_alive_zero_unloads_right_after_it(
        make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()  # configured to keep its model
    run(eng, PROMPTS[0], keep_alive=0)
    unloaded(eng)
    run(eng, PROMPTS[0])  # a request without one brings back the configured keep_alive
    assert eng.stats().loads == 2
    run(eng, PROMPTS[1])
    assert (eng.stats().loads, eng.stats().unloads) == (2, 1)


def test_a_request_submitted_during_the_unload_waits_and_succeeds(
        make_engine: Callable[..., Engine]) -> None:
    held = HeldStage()
    eng = make_engine(probe=StepProbe(on_model=held))
    expected = run(eng, PROMPTS[2])
    held.hold("unloading")
    run(eng, PROMPTS[2], keep_alive=0)
    assert held.reached.wait(30)
    handle = eng.submit(request_for(PROMPTS[2], greedy(12)))  # while the model goes
    held.go.set()
    assert handle.result(timeout=60).token_ids == expected
    assert eng.stats().loads == 2 and held.stages == ["loading", "unloading", "loading"]


def test_a_probe_is_handed_each_loads_lanes_on_the_engine_thread_before_any_row(
        make_engine: Callable[..., Engine]) -> None:
    seen: list[tuple[threading.Thread, int]] = []

    def on_lanes(lanes: Any) -> None:
        seen.append((threading.current_thread(), len(lanes.batch) + len(lanes.serial)))

    eng = make_engine(probe=StepProbe(on_lanes=on_lanes))
    run(eng, PROMPTS[1], keep_alive=0)
    unloaded(eng)
    run(eng, PROMPTS[1])
    assert [rows for _, rows in seen] == [0, 0]  # the first load and the reload
    assert seen[0][0] is seen[1][0] is not threading.current_thread()
    with pytest.raises(TypeError, match="on_lanes must be callable"):
        StepProbe(on_lanes=1)  # type: ignore[arg-type]


def test_requests_arriving_while_unloaded_share_one_reload(
        make_engine: Callable[..., Engine]) -> None:
    held = HeldStage()
    eng = make_engine(max_batch=8, probe=StepProbe(on_model=held))
    expected = [run(eng, prompt) for prompt in PROMPTS]
    run(eng, PROMPTS[0], keep_alive=0)
    unloaded(eng)
    held.hold("loading")
    handles = [eng.submit(request_for(prompt, greedy(12))) for prompt in PROMPTS]
    assert held.reached.wait(30)  # the first request started the reload; the rest wait
    held.go.set()
    assert [h.result(timeout=60).token_ids for h in handles] == expected
    stats = eng.stats()
    assert (stats.loads, stats.unloads, stats.failed) == (2, 1, 0)
    assert stats.peak_running == len(PROMPTS)  # they ran as one batch after the reload


async def test_concurrent_callers_after_an_unload_share_one_reload(
        make_engine: Callable[..., Engine]) -> None:
    eng = make_engine(max_batch=8)
    run(eng, PROMPTS[0], keep_alive=0)
    unloaded(eng)
    handles = await asyncio.gather(*(asyncio.to_thread(
        eng.submit, request_for(prompt, greedy(12))) for prompt in PROMPTS))
    results = await asyncio.gather(*(handle.aresult() for handle in handles))
    assert [r.usage.completion_tokens for r in results] == [12] * len(PROMPTS)
    assert (eng.stats().loads, eng.stats().failed) == (2, 0)


def test_cancel_while_waiting_for_the_reload(make_engine: Callable[..., Engine]) -> None:
    held = HeldStage()
    eng = make_engine(probe=StepProbe(on_model=held))
    run(eng, PROMPTS[0], keep_alive=0)
    unloaded(eng)
    prompt_tokens = eng.stats().prompt_tokens
    held.hold("loading")
    cancelled = eng.submit(request_for(PROMPTS[1], greedy(12)))
    assert held.reached.wait(30)
    kept = eng.submit(request_for(PROMPTS[2], greedy(12)))
    cancelled.cancel()
    held.go.set()
    assert cancelled.result(timeout=60).finish_reason is FinishReason.CANCELLED
    assert kept.result(timeout=60).usage.completion_tokens == 12
    stats = eng.stats()
    assert (stats.cancelled, stats.completed, stats.loads) == (1, 2, 2)
    # Cancelled before the plan that followed the load: it was never prefilled.
    assert stats.prompt_tokens - prompt_tokens == kept.result().usage.prompt_tokens


def test_constraints_compile_again_after_a_reload(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()
    code = TextRequest("code:", greedy(20, constraint=Regex(r"[A-Z]{3}-[0-9]{4}")))
    before = eng.submit(code, keep_alive=0).result(timeout=60)
    unloaded(eng)  # its compiled grammar went with the model
    after = eng.submit(code).result(timeout=60)
    assert after.text == before.text and re.fullmatch(r"[A-Z]{3}-[0-9]{4}", after.text)
    assert eng.stats().live_matchers == 0


def test_the_tokenizer_stays_and_start_reloads(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine(keep_alive=0)
    unloaded(eng)  # start() loaded it; idle at once, it went
    tokens = eng.count_tokens(TextRequest("hello there", greedy(4)))
    assert tokens == len(eng.tokenizer.encode("hello there"))
    assert eng.stats().loads == 1 and not eng.stats().loaded  # neither reloaded it
    eng.start()
    assert eng.stats().loads == 2


def test_an_idle_engine_waits_for_its_keep_alive_without_turning(
        make_engine: Callable[..., Engine]) -> None:
    turns = Turns()
    eng = make_engine(keep_alive=600, probe=turns.probe)
    run(eng, PROMPTS[0])
    turns.settled()
    settled = len(turns.reports)
    threading.Event().wait(0.3)  # an idle loop that polled would take turns meanwhile
    assert len(turns.reports) <= settled + 1 and eng.stats().loaded


def test_the_prefix_disk_tier_outlives_an_unload(make_engine: Callable[..., Engine],
                                                 tmp_path: Path) -> None:
    system = "You are an agent with tools. " + " ".join(
        f"tool{i}: does thing {i}." for i in range(60))

    def conversation(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    cold = make_engine(prefix_cache_bytes=0)
    expected = cold.submit(request_for(conversation("What is second?"), greedy(16)))
    eng = make_engine(prefix_cache_dir=str(tmp_path))
    run(eng, conversation("What is first?"), 16, keep_alive=0)
    unloaded(eng)
    wait_until(lambda: bool(list(tmp_path.rglob("*.prefix"))))  # written behind the unload
    result = eng.submit(request_for(conversation("What is second?"), greedy(16))).result(60)
    assert result.token_ids == expected.result(timeout=60).token_ids
    assert result.usage.cached_tokens > 100  # the system head, read back from disk
    assert eng.stats().prefix_disk_hits == 1


def test_embeddings_run_while_the_chat_model_is_unloaded(
        make_engine: Callable[..., Engine], embedding_model_dir: Path) -> None:
    eng = make_engine(keep_alive=0)
    unloaded(eng)
    vectors = eng.embed(["a cat", "a dog"], embedding_model_dir).result(timeout=120)
    assert vectors.vectors.shape[0] == 2
    stats = eng.stats()
    assert (stats.loaded, stats.loads) == (False, 1)  # the chat model was not reloaded
    run(eng, PROMPTS[0])
    assert eng.stats().loads == 2


def test_keep_alive_is_checked_where_it_is_given(make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(ValueError, match="keep_alive must be >= 0"):
        EngineConfig(keep_alive=-1)
    with pytest.raises(ValueError, match="sharded engine keeps"):
        EngineConfig(keep_alive=5, shard="tensor")
    eng = make_engine()
    request = TextRequest("hi", greedy(2))
    with pytest.raises(ValueError, match="keep_alive must be a finite number"):
        eng.submit(request, keep_alive=-5)
    with pytest.raises(TypeError, match="keep_alive must be seconds"):
        eng.submit(request, keep_alive="5m")  # type: ignore[arg-type]
