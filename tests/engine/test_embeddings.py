"""Embeddings on the engine thread: equal to an independent numpy BERT, batched == alone,
truncation, batching across threads, beside generating rows, a large request split into
chunks, cancellation (waiting and mid-batch), the sharded watchdog's failure path, bad
input."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine import (
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    RequestCancelledError,
    RequestTimeoutError,
    StepProbe,
    TextRequest,
    TurnReport,
)
from testkit.numpy_bert import NumpyBert
from tests.conftest import HeldEmbeddings, greedy, request_for, threads_started_by, wait_until

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Batching keeps the cores busy.",
    "",
    "Ünïcödé, punctuation!? and numbers 12345 in one line; with (brackets).",
    " ".join(["a long sentence that repeats itself"] * 12),
]
LONG = " ".join(f"word{i}" for i in range(400))  # well past 256 word pieces


@pytest.fixture(scope="module")
def reference(embedding_model_dir: Path) -> NumpyBert:
    return NumpyBert(embedding_model_dir)


def vectors(eng: Engine, model: Path, texts: list[str]) -> np.ndarray:
    return eng.embed(texts, model).result(timeout=60).vectors


def test_equal_to_an_independent_numpy_bert(embedding_engine: Engine, embedding_model_dir: Path,
                                            reference: NumpyBert) -> None:
    got = vectors(embedding_engine, embedding_model_dir, [*SENTENCES, LONG])
    for text, vector in zip([*SENTENCES, LONG], got, strict=True):
        want = reference.embed(text)
        cosine = float(vector @ want) / float(np.linalg.norm(vector))
        assert cosine >= 0.9999, (text[:40], cosine)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)  # L2-normalised


def test_the_documented_pair(embedding_engine: Engine, embedding_model_dir: Path) -> None:
    pair = vectors(embedding_engine, embedding_model_dir, SENTENCES[:2])
    assert float(pair[0] @ pair[1]) == pytest.approx(0.7553, abs=0.0005)


def test_batched_equals_alone(embedding_engine: Engine, embedding_model_dir: Path) -> None:
    texts = [*SENTENCES, LONG]
    together = vectors(embedding_engine, embedding_model_dir, texts)
    for text, vector in zip(texts, together, strict=True):
        alone = vectors(embedding_engine, embedding_model_dir, [text])[0]
        np.testing.assert_allclose(vector, alone, atol=2e-6)


def test_truncated_at_max_seq_length(embedding_engine: Engine,
                                     embedding_model_dir: Path) -> None:
    result = embedding_engine.embed([LONG, LONG + " and a different ending"],
                                    embedding_model_dir).result(timeout=60)
    assert result.prompt_tokens == 2 * 256  # [CLS] + 254 pieces + [SEP], each
    np.testing.assert_array_equal(result.vectors[0], result.vectors[1])


def test_requests_from_many_threads_share_batches(embedding_engine: Engine,
                                                  embedding_model_dir: Path) -> None:
    alone = {text: vectors(embedding_engine, embedding_model_dir, [text])[0]
             for text in SENTENCES}
    before = embedding_engine.stats()
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(SENTENCES))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = vectors(embedding_engine, embedding_model_dir, [SENTENCES[i]])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(SENTENCES))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = embedding_engine.stats()
    assert after.embed_requests - before.embed_requests == len(SENTENCES)
    assert after.embed_batches - before.embed_batches < len(SENTENCES)  # some ran together
    for i, text in enumerate(SENTENCES):
        np.testing.assert_allclose(results[i], alone[text], atol=2e-6)


async def test_async_callers_batch_together(embedding_engine: Engine,
                                            embedding_model_dir: Path) -> None:
    before = embedding_engine.stats().embed_batches
    results = await asyncio.gather(*(embedding_engine.embed([t], embedding_model_dir).aresult()
                                     for t in SENTENCES))
    assert embedding_engine.stats().embed_batches - before < len(SENTENCES)
    assert [r.vectors.shape for r in results] == [(1, 384)] * len(SENTENCES)


def test_an_embeddings_only_engine_never_loads_its_chat_model(
        embedding_engine: Engine) -> None:
    stats = embedding_engine.stats()
    assert not stats.loaded and stats.steps == 0 and stats.embed_batches >= 1


def test_beside_generating_rows_their_tokens_are_unchanged(
        make_engine: Callable[..., Engine], embedding_model_dir: Path) -> None:
    turns: list[tuple[int, int]] = []

    def on_turn(report: TurnReport) -> None:
        turns.append((report.stats.running, report.stats.embed_batches))

    probe = StepProbe(on_turn)
    eng = make_engine(probe=probe, max_batch=8, embed_window=0.0)
    prompts = [f"Count from {i} to {i + 30}:" for i in range(4)]
    params = greedy(max_tokens=40, ignore_eos=True)
    alone = [eng.submit(request_for(p, params)).result(timeout=60).token_ids for p in prompts]
    probe.slow_steps(0.01)  # the rows decode for a while: embeddings land between steps
    handles = [eng.submit(request_for(p, params)) for p in prompts]
    wait_until(lambda: eng.stats().running == len(prompts))
    embedded = [eng.embed(SENTENCES, embedding_model_dir).result(timeout=60) for _ in range(3)]
    together = [h.result(timeout=60).token_ids for h in handles]
    assert together == alone
    assert all(e.vectors.shape == (len(SENTENCES), 384) for e in embedded)
    ran_beside = [b for (running, b), (_, prev) in zip(turns[1:], turns, strict=False)
                  if running > 0 and b > prev]
    assert ran_beside, "no embedding batch ran while rows were generating"


def test_a_large_request_runs_in_chunks_between_decode_steps(
        make_engine: Callable[..., Engine], embedding_engine: Engine,
        embedding_model_dir: Path) -> None:
    texts = [*SENTENCES, LONG, *(f"chunk sentence number {i}." for i in range(6))]  # 14
    unsplit = vectors(embedding_engine, embedding_model_dir, texts)  # embed_max_batch 64
    turns: list[tuple[int, int]] = []
    probe = StepProbe(lambda r: turns.append((r.stats.running, r.stats.embed_batches)))
    eng = make_engine(probe=probe, max_batch=4, embed_window=0.0, embed_max_batch=4,
                      embed_share=1.0)
    prompts = [f"Count from {i} to {i + 30}:" for i in range(3)]
    params = greedy(max_tokens=40, ignore_eos=True)
    alone = [eng.submit(request_for(p, params)).result(timeout=60).token_ids for p in prompts]
    eng.embed(["warm up"], embedding_model_dir).result(timeout=60)  # the encoder loads
    probe.slow_steps(0.01)
    handles = [eng.submit(request_for(p, params)) for p in prompts]
    wait_until(lambda: eng.stats().running == len(prompts))
    before = eng.stats().embed_batches
    result = eng.embed(texts, embedding_model_dir).result(timeout=60)
    assert [h.result(timeout=60).token_ids for h in handles] == alone
    np.testing.assert_allclose(result.vectors, unsplit, atol=2e-6)  # split == unsplit
    stats = eng.stats()
    assert stats.embed_batches - before == 4 and stats.embed_peak_batch_texts == 4
    assert result.prompt_tokens == embedding_engine.embed(
        texts, embedding_model_dir).result(timeout=60).prompt_tokens
    ran = [b - prev for (_, b), (_, prev) in zip(turns[1:], turns, strict=False)]
    assert max(ran) == 1  # one chunk per turn, never the whole request at once
    beside = sum(b - prev for (running, b), (_, prev) in zip(turns[1:], turns, strict=False)
                 if running > 0)
    assert beside >= 2, "the chunks did not run between the rows' decode steps"


def settled(eng: Engine, *, cancelled: int, requests: int) -> bool:
    """The engine's embedding counts have reached these (stats() takes them at the end of
    the turn that finished the handles, a moment after their callers wake)."""
    stats = eng.stats()
    return stats.embed_cancelled == cancelled and stats.embed_requests == requests


def test_a_request_cancelled_while_its_batch_runs_gets_no_vectors(
        tiny_model_dir: Path, embedding_engine: Engine, embedding_model_dir: Path) -> None:
    texts = SENTENCES[:3]
    alone = [vectors(embedding_engine, embedding_model_dir, [t])[0] for t in texts]
    # Three one-text requests fill a batch of three: due together, long before the window.
    held = HeldEmbeddings()
    with Engine(tiny_model_dir, EngineConfig(embed_window=1.0, embed_max_batch=3),
                probe=StepProbe(on_embed=held)) as eng:
        eng.embed(texts, embedding_model_dir).result(timeout=60)  # loads the encoder
        held.armed = True  # each batch from now on holds the engine thread until go
        started, go, calls = held.started, held.go, held.calls
        first, cancelled, last = (eng.embed([t], embedding_model_dir) for t in texts)
        assert started.wait(30)
        cancelled.cancel()  # its batch is running now
        go.set()
        with pytest.raises(RequestCancelledError):
            cancelled.result(timeout=30)
        for handle, want in ((first, alone[0]), (last, alone[2])):
            np.testing.assert_allclose(handle.result(timeout=30).vectors[0], want, atol=2e-6)
        assert calls == [texts]  # all three were in the running batch
        # stats() takes the service's counts at the end of the turn that finished a handle.
        wait_until(lambda: settled(eng, cancelled=1, requests=3))
        stats = eng.stats()
        assert (stats.embed_requests, stats.embed_texts) == (3, 5)  # the warm-up's 3 + 2


class _StuckStep(StepProbe):
    """Parks the engine thread in a lane step once armed, as a collective no other rank
    joins does; released, the step raises ``EngineDeadError`` as the sharded lane does."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.parked, self.release = (threading.Event() for _ in range(3))

    def before_step(self, lane: str) -> None:
        if self.armed.is_set():
            self.parked.set()
            self.release.wait(30)
            raise EngineDeadError("the collective returned after the watchdog gave up")
        super().before_step(lane)


def test_the_watchdog_fails_waiting_embeddings_without_touching_the_batcher(
        tiny_model_dir: Path, embedding_model_dir: Path) -> None:
    stuck = _StuckStep()
    engines: list[Engine] = []
    started = threads_started_by(lambda: engines.append(
        Engine(tiny_model_dir, EngineConfig(embed_window=1.0), probe=stuck).start()))
    eng = engines[0]
    try:
        eng.embed(["warm up"] * 64, embedding_model_dir).result(timeout=60)  # a full batch
        waiting = eng.embed(["waiting for its window"], embedding_model_dir)
        wait_until(lambda: eng.stats().embed_pending == 1)  # in the engine thread's batcher
        stuck.armed.set()
        row = eng.submit(TextRequest("Hello", greedy(max_tokens=4)))
        assert stuck.parked.wait(30)
        assert not waiting.done, "precondition: the window passed before the step parked"
        dead = EngineDeadError("a rank of the sharded engine did not answer")
        eng._runtime.abandon(dead)  # what the watchdog thread calls (here: the test's thread)
        with pytest.raises(EngineDeadError):
            waiting.result(timeout=10)
        with pytest.raises(EngineDeadError):
            row.result(timeout=10)
        with pytest.raises(EngineDeadError):
            eng.embed(["after"], embedding_model_dir)
        # The batcher is the engine thread's: the watchdog left it as it was.
        assert len(eng._runtime.embeddings.batcher) == 1 and eng.stats().embed_failed == 1
        stuck.release.set()  # the step "returns": the engine thread dies and drains it
        for thread in started:
            thread.join(30)
        assert not any(thread.is_alive() for thread in started)
        assert len(eng._runtime.embeddings.batcher) == 0
        assert eng._runtime.embeddings.counters.failed == 0  # already failed: not counted again
    finally:
        stuck.release.set()
        eng.close()


def test_chat_can_start_after_embeddings(tiny_model_dir: Path,
                                         embedding_model_dir: Path) -> None:
    eng = Engine(tiny_model_dir, EngineConfig())
    try:
        eng.embed(["first"], embedding_model_dir).result(timeout=60)
        assert not eng.stats().loaded
        completion = eng.submit(TextRequest("Hello", greedy(max_tokens=4))).result(timeout=60)
        assert completion.usage.completion_tokens == 4 and eng.stats().loaded
        after = eng.embed(["after"], embedding_model_dir).result(timeout=60)
        assert after.vectors.shape == (1, 384)
    finally:
        eng.close()


def test_a_cancelled_embedding_never_runs(tiny_model_dir: Path,
                                          embedding_model_dir: Path) -> None:
    with Engine(tiny_model_dir, EngineConfig(embed_window=0.3)) as eng:
        cancelled = eng.embed(["never embedded"], embedding_model_dir)
        cancelled.cancel()
        with pytest.raises(RequestCancelledError):
            cancelled.result(timeout=5)
        eng.embed(["embedded"], embedding_model_dir).result(timeout=60)
        wait_until(lambda: settled(eng, cancelled=1, requests=1))
        stats = eng.stats()
        assert (stats.embed_texts, stats.embed_requests) == (1, 1)


async def test_cancelling_the_awaiting_task_cancels_the_embedding(
        tiny_model_dir: Path, embedding_model_dir: Path) -> None:
    with Engine(tiny_model_dir, EngineConfig(embed_window=0.3)) as eng:
        handle = eng.embed(["never embedded"], embedding_model_dir)
        task = asyncio.create_task(handle.aresult())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handle.done
        await eng.embed(["embedded"], embedding_model_dir).aresult()
        wait_until(lambda: settled(eng, cancelled=1, requests=1))
        assert eng.stats().embed_texts == 1


@pytest.mark.parametrize("wait", ["sync", "async"])
def test_a_timed_out_embedding_never_runs(tiny_model_dir: Path, embedding_model_dir: Path,
                                          wait: str) -> None:
    with Engine(tiny_model_dir, EngineConfig(embed_window=0.5)) as eng:
        handle = eng.embed(["too late"], embedding_model_dir, timeout=0.05)
        with pytest.raises(RequestTimeoutError):
            if wait == "sync":
                handle.result()
            else:
                asyncio.run(handle.aresult())
        eng.embed(["in time"], embedding_model_dir).result(timeout=60)
        wait_until(lambda: settled(eng, cancelled=1, requests=1))
        assert eng.stats().embed_texts == 1


def test_close_fails_waiting_embeddings(tiny_model_dir: Path,
                                        embedding_model_dir: Path) -> None:
    eng = Engine(tiny_model_dir, EngineConfig(embed_window=1.0))
    handle = eng.embed(["waiting"], embedding_model_dir)
    eng.close()
    with pytest.raises(EngineClosedError):
        handle.result(timeout=10)
    with pytest.raises(EngineClosedError):
        eng.embed(["after close"], embedding_model_dir)


@pytest.mark.parametrize(("texts", "error"), [
    ("a string, not a list", TypeError), ([b"bytes"], TypeError), (["ok", 7], TypeError),
    (None, TypeError), (["x"] * 2049, ValueError)])
def test_bad_input_is_refused_on_the_callers_thread(embedding_engine: Engine,
                                                    embedding_model_dir: Path, texts: object,
                                                    error: type) -> None:
    with pytest.raises(error):
        embedding_engine.embed(texts, embedding_model_dir)  # type: ignore[arg-type]


def test_bad_models_and_empty_input(embedding_engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        embedding_engine.embed(["x"], 3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        embedding_engine.embed(["x"], tmp_path / "missing")
    empty = embedding_engine.embed([]).result(timeout=1)
    assert empty.vectors.shape[0] == 0 and empty.prompt_tokens == 0


def test_trio_callers_await_embeddings(embedding_engine: Engine,
                                       embedding_model_dir: Path) -> None:
    trio = pytest.importorskip("trio", reason="trio (the dev extra) is not installed")

    async def main() -> np.ndarray:
        return (await embedding_engine.embed(SENTENCES[:2], embedding_model_dir).aresult()).vectors

    pair = trio.run(main)
    assert float(pair[0] @ pair[1]) == pytest.approx(0.7553, abs=0.0005)


def test_the_process_embeds_on_the_engine_serving_chat(tiny_model_dir: Path) -> None:
    from engine import get_embedding_engine, get_engine
    from engine.registry import close_all

    close_all()
    try:
        idle = get_engine()  # never asked for chat: not preferred
        chat = get_engine(tiny_model_dir).start()
        assert get_embedding_engine() is chat
        chat.close()
        assert get_embedding_engine() is idle  # a closed engine is passed over
        assert not idle.stats().loaded
    finally:
        close_all()
