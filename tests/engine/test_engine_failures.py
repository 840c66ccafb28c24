"""Failure containment, the serial lane, logprobs, stop strings, shutdown."""

from __future__ import annotations

import threading

import pytest

from engine import (
    Engine,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    FinishReason,
    SamplingParams,
    StepProbe,
    TextRequest,
)
from tests.conftest import (
    alone,
    greedy,
    prompts_of_lengths,
    request_for,
    threads_started_by,
    wait_until,
)


def test_raising_callback_fails_only_its_row(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [10, 20, 30], seed=31)
    reference = alone(tiny_engine, prompts, greedy(30))

    def explode(_t: int, _d: str) -> None:
        raise RuntimeError("callback bug")

    handles = [tiny_engine.submit(request_for(p, greedy(30)), on_token=explode if i == 1 else None)
               for i, p in enumerate(prompts)]
    with pytest.raises(RuntimeError, match="callback bug"):
        handles[1].result()
    assert [handles[i].result().token_ids for i in (0, 2)] == [reference[0], reference[2]]
    wait_until(lambda: tiny_engine.stats().running == 0)


def test_raising_logits_processor_fails_only_its_row(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [12, 22], seed=32)
    reference = alone(tiny_engine, prompts, greedy(30))
    calls = [0]

    def flaky(tokens, logits):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 4:
            raise ValueError("processor bug")
        return logits

    bad = tiny_engine.submit(request_for(prompts[0], greedy(30, logits_processors=(flaky,))))
    good = tiny_engine.submit(request_for(prompts[1], greedy(30)))
    with pytest.raises(ValueError, match="processor bug"):
        bad.result()
    assert good.result().token_ids == reference[1]
    # The engine still serves the failed row's prompt normally afterwards.
    assert tiny_engine.submit(request_for(prompts[0],
                                          greedy(30))).result().token_ids == reference[0]


def test_step_failure_fails_rows_in_flight_then_recovers(make_engine) -> None:  # type: ignore[no-untyped-def]
    """One injected step fault: the rows in flight fail with EngineError (the fault as
    cause); a row still waiting then, and rows submitted after, run as if alone."""
    probe = StepProbe()
    eng = make_engine(probe=probe, max_batch=3, prefill_chunk=64)
    prompts = prompts_of_lengths(eng, [15, 25, 35, 20], seed=37)
    expected = alone(eng, prompts, greedy(20))
    started: set[int] = set()

    def starter(i: int):  # type: ignore[no-untyped-def]
        return lambda _t, _d: started.add(i)

    # Long rows, so they are surely still decoding when the fault comes.
    in_flight = [eng.submit(request_for(p, greedy(400)), on_token=starter(i))
                 for i, p in enumerate(prompts[:3])]
    waiting = eng.submit(request_for(prompts[3], greedy(20)))  # max_batch=3: not admitted yet
    wait_until(lambda: len(started) == 3)
    fault = RuntimeError("simulated device fault")
    probe.fail_next(fault)
    for handle in in_flight:
        with pytest.raises(EngineError) as info:
            handle.result(timeout=30)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert info.value.__cause__ is fault and not isinstance(info.value, EngineDeadError)
    assert probe.faults_raised == 1
    assert waiting.result(timeout=30).token_ids == expected[3]
    later = [eng.submit(request_for(p, greedy(20))) for p in prompts]
    assert [h.result(timeout=30).token_ids for h in later] == expected
    assert eng.submit(request_for(prompts[0],
                                  greedy(20))).result(timeout=30).token_ids == expected[0]
    wait_until(lambda: eng.stats().running == 0)
    assert eng.stats().failed == 3


def test_persistent_step_failure_kills_the_engine_and_nobody_hangs(make_engine) -> None:  # type: ignore[no-untyped-def]
    probe = StepProbe()
    eng = make_engine(probe=probe, max_batch=1, max_consecutive_step_failures=2)
    tokens: list[int] = []
    # max_batch=1: the first two fail in their own steps, the third is still pending.
    handles = [eng.submit(TextRequest(f"hello {i}", greedy(300)),
                          on_token=(lambda t, _: tokens.append(t)) if i == 0 else None)
               for i in range(3)]
    wait_until(lambda: len(tokens) > 0)  # the first row is decoding
    fault = RuntimeError("device lost")
    probe.fail_always(fault)
    for handle in handles[:2]:
        with pytest.raises(EngineError) as info:
            handle.result(timeout=30)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert info.value.__cause__ is fault and not isinstance(info.value, EngineDeadError)
    with pytest.raises(EngineDeadError):
        handles[2].result(timeout=30)
    with pytest.raises(EngineDeadError):
        eng.submit(TextRequest("later", greedy(3)))
    assert probe.faults_raised == 2


def test_after_the_last_allowed_failure_every_waiter_gets_engine_dead(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Faults on every step: the rows of the failing steps fail with EngineError, the moment
    the limit is reached every other waiter (sync or async) gets EngineDeadError, and so
    does every later submit, at once."""
    import asyncio

    probe = StepProbe()
    eng = make_engine(probe=probe, max_batch=2, max_consecutive_step_failures=3)
    handles = [eng.submit(TextRequest(f"request {i}", greedy(400))) for i in range(10)]
    fault = RuntimeError("device lost for good")
    probe.fail_always(fault)  # armed after the submits: none of them can meet a dead engine

    async def await_last() -> BaseException:
        with pytest.raises(EngineDeadError) as info:
            await handles[-1].aresult()
        return info.value

    dead = asyncio.run(asyncio.wait_for(await_last(), timeout=30))
    errors = []
    for handle in handles:
        with pytest.raises(EngineError) as info:
            handle.result(timeout=30)
        errors.append(info.value)
    step_failures = [e for e in errors if not isinstance(e, EngineDeadError)]
    assert probe.faults_raised == 3
    assert 3 <= len(step_failures) <= 6  # one or two rows in each failed step
    assert errors[:len(step_failures)] == step_failures  # FIFO: the first rows met the faults
    assert all(e.__cause__ is fault for e in step_failures)
    assert dead.__cause__ is fault and "3 model steps failed" in str(dead)
    with pytest.raises(EngineDeadError):
        eng.submit(TextRequest("later", greedy(3)))
    with pytest.raises(EngineDeadError):
        eng.start()
    assert eng.stats().failed == 10


def test_load_failure_is_reported_not_hung(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    eng = Engine(tmp_path)
    handle = eng.submit(TextRequest("x", greedy(3)))
    with pytest.raises(EngineDeadError):
        handle.result(timeout=30)
    with pytest.raises(EngineDeadError):
        eng.start()
    eng.close()


def test_close_cancels_in_flight_and_rejects_later_submits(make_engine) -> None:  # type: ignore[no-untyped-def]
    engines: list[Engine] = []
    started = threads_started_by(lambda: engines.append(make_engine()))
    eng = engines[0]
    tokens: list[int] = []
    handle = eng.submit(TextRequest("a long one", greedy(1500)), on_token=lambda t,
                        _: tokens.append(t))
    wait_until(lambda: len(tokens) > 2)
    eng.close()
    with pytest.raises(EngineClosedError):
        handle.result(timeout=10)
    with pytest.raises(EngineClosedError):
        eng.submit(TextRequest("after", greedy(2)))
    assert started and not any(thread.is_alive() for thread in started)


def test_seeded_sampling_runs_serially_and_reproduces(tiny_engine: Engine) -> None:
    prompt = prompts_of_lengths(tiny_engine, [14], seed=33)[0]
    params = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=1234)
    first = tiny_engine.submit(request_for(prompt, params)).result().token_ids
    # Same seed beside busy random neighbours: same tokens.
    noise = [tiny_engine.submit(request_for(prompt, SamplingParams(max_tokens=40, temperature=1.0)))
             for _ in range(4)]
    again = tiny_engine.submit(request_for(prompt, params)).result().token_ids
    for h in noise:
        h.result()
    assert first == again
    other = tiny_engine.submit(request_for(prompt, SamplingParams(max_tokens=25, temperature=1.0,
                                                      seed=99))).result().token_ids
    assert other != first


def test_non_batchable_caches_run_on_the_serial_lane(make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import QuantizedKVCache

    reference_engine = make_engine()
    prompts = prompts_of_lengths(reference_engine, [10, 30, 20], seed=34)
    monkeypatch.setattr(qwen2.Model, "make_cache", lambda self: [
        QuantizedKVCache(group_size=32, bits=8) for _ in self.layers], raising=False)
    eng = make_engine(max_batch=8)
    assert eng.stats().batch_mode == "serial"
    tokens: list[int] = []
    handles = [eng.submit(request_for(p, greedy(20)),
                          on_token=(lambda t, _: tokens.append(t)) if i == 0
                          else None) for i, p in enumerate(prompts)]
    wait_until(lambda: len(tokens) >= 3)
    handles[1].cancel()
    results = [h.result(timeout=60) for h in handles]
    assert results[1].finish_reason is FinishReason.CANCELLED
    assert all(r.usage.completion_tokens == 20 for r in (results[0], results[2]))
    assert eng.stats().peak_running == 1
    serial_alone = eng.submit(request_for(prompts[2], greedy(20))).result().token_ids
    assert results[2].token_ids == serial_alone


def test_logprobs_are_reported_per_token(tiny_engine: Engine) -> None:
    import math

    params = greedy(6, logprobs=True, top_logprobs=3)
    result = tiny_engine.submit(TextRequest("logprobs please", params)).result()
    assert result.logprobs is not None and len(result.logprobs) == 6
    for lp, token in zip(result.logprobs, result.token_ids):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy picks the top token
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-5)
    assert tiny_engine.submit(TextRequest("no logprobs", greedy(3))).result().logprobs is None


def test_stop_strings_and_stop_token_ids_end_to_end(tiny_engine: Engine) -> None:
    prompt = prompts_of_lengths(tiny_engine, [11], seed=35)[0]
    full = tiny_engine.submit(request_for(prompt, greedy(40))).result()
    stop_text = full.text[len(full.text) // 2:][:3]
    assert stop_text.strip(), "need some visible text to stop on"
    streamed = []
    for event in tiny_engine.submit(request_for(prompt, greedy(40, stop=(stop_text,)))):
        streamed.append(event.text)
    assert "".join(streamed) == full.text[: full.text.index(stop_text)]
    assert stop_text not in "".join(streamed)
    by_id_params = greedy(40, stop_token_ids=(full.token_ids[5],))
    by_id = tiny_engine.submit(request_for(prompt, by_id_params)).result()
    assert by_id.finish_reason is FinishReason.STOP
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[5])]


def test_usage_and_stats_add_up(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine()
    prompts = prompts_of_lengths(eng, [10, 20], seed=36)
    results = [eng.submit(request_for(p, greedy(7))).result() for p in prompts]
    stats = eng.stats()
    assert stats.prompt_tokens == 30 and stats.generated_tokens == 14 and stats.completed == 2
    for r in results:
        assert r.usage.completion_tokens == 7 and r.usage.time_to_first_token > 0
        assert r.usage.decode_tokens_per_second and r.usage.decode_tokens_per_second > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_engine_thread_is_the_only_one_touching_mlx(make_engine) -> None:  # type: ignore[no-untyped-def]
    seen: set[str] = set()
    engines: list[Engine] = []
    started = threads_started_by(lambda: engines.append(make_engine(
        probe=StepProbe(on_step=lambda _lane: seen.add(threading.current_thread().name)))))
    eng = engines[0]
    threads = [threading.Thread(target=lambda: eng.submit(TextRequest("hi", greedy(5))).result())
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every lane step ran on the one thread the engine started, none on a caller's.
    assert seen and seen == {thread.name for thread in started}
