"""The embedding batcher, the share policy and the checks on texts: no model, no mlx."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine import EngineDeadError, RequestCancelledError, RequestTimeoutError, check_texts
from engine.embedding.batcher import EmbeddingBatcher
from engine.embedding.request import EmbeddingRequest, Embeddings
from engine.embedding.service import EmbeddingService

A, B = Path("/models/a"), Path("/models/b")


def request(n: int, at: float, model: Path = A, deadline: float | None = None,
            request_id: int = 1) -> EmbeddingRequest:
    return EmbeddingRequest(request_id, tuple(f"t{i}" for i in range(n)), model, model.name,
                            at, deadline)


def test_waits_for_the_window_then_takes_everything_of_one_model() -> None:
    batcher = EmbeddingBatcher(window=0.01, max_batch=8)
    first, second, other = request(2, 0.0), request(3, 0.005), request(1, 0.006, B)
    for r in (first, second, other):
        batcher.add(r.model_path, r)
    assert batcher.due_at() == pytest.approx(0.01)
    assert batcher.take(0.009) is None
    batch = batcher.take(0.01)
    assert batch is not None and batch.requests == [first, second]
    assert batch.texts == ["t0", "t1", "t0", "t1", "t2"]
    rest = batcher.take(0.02)
    assert rest is not None and rest.requests == [other] and len(batcher) == 0


def test_a_full_batch_is_due_at_once_and_never_exceeds_max_batch() -> None:
    batcher = EmbeddingBatcher(window=10.0, max_batch=4)
    requests = [request(2, 0.0), request(2, 0.0), request(2, 0.0)]
    for r in requests:
        batcher.add(A, r)
    batch = batcher.take(0.0)
    assert batch is not None and batch.requests == requests[:2]
    assert batcher.take(0.0) is None  # two texts left: they wait for the window


def test_a_request_larger_than_max_batch_is_split_and_its_rest_is_due_at_once() -> None:
    batcher = EmbeddingBatcher(window=10.0, max_batch=4)
    big, small = request(9, 0.0), request(1, 0.0)
    batcher.add(A, big)
    batcher.add(A, small)
    spans = []
    for _ in range(3):  # the window is long, but a started request never waits again
        assert batcher.due_at() == 0.0
        batch = batcher.take(0.0)
        assert batch is not None and len(batch.texts) <= 4
        spans.append([(s.request, s.start, s.end) for s in batch.spans])
    # Chunks of at most max_batch, oldest first; the small request fills the last one.
    assert spans == [[(big, 0, 4)], [(big, 4, 8)], [(big, 8, 9), (small, 0, 1)]]
    assert len(batcher) == 0 and batcher.take(100.0) is None


def test_a_split_request_keeps_its_place_and_never_mixes_models() -> None:
    batcher = EmbeddingBatcher(window=0.0, max_batch=4)
    big, other, after = request(6, 0.0), request(1, 0.0, B), request(3, 0.0)
    for r in (big, other, after):
        batcher.add(r.model_path, r)
    first, second = batcher.take(0.0), batcher.take(0.0)
    assert first is not None and [(s.request, s.end) for s in first.spans] == [(big, 4)]
    # The rest (2) and the next whole request of its model (3) do not fit together: the
    # rest runs, and a whole request is never split to fill a batch.
    assert second is not None and [(s.request, s.end) for s in second.spans] == [(big, 6)]
    third = batcher.take(0.0)
    assert third is not None and third.requests == [other]


def test_cancelled_and_expired_requests_are_dropped_unrun() -> None:
    batcher = EmbeddingBatcher(window=0.0, max_batch=8)
    cancelled, expired, kept = request(1, 0.0), request(1, 0.0, deadline=0.5), request(1, 0.0)
    for r in (cancelled, expired, kept):
        batcher.add(A, r)
    cancelled.cancel()
    assert batcher.drop_finished(now=1.0) == [cancelled, expired]
    with pytest.raises(RequestTimeoutError):
        expired.outcome()
    with pytest.raises(RequestCancelledError):
        cancelled.outcome()
    batch = batcher.take(1.0)
    assert batch is not None and batch.requests == [kept]


def test_first_finish_wins() -> None:
    r = request(1, 0.0)
    assert r.cancel() is True
    assert r.finish(error=RuntimeError("late")) is False
    with pytest.raises(RequestCancelledError):
        r.outcome()


@pytest.mark.parametrize(("texts", "error"), [
    ("one string", TypeError), (b"bytes", TypeError), (["ok", b"bytes"], TypeError),
    (["ok", 3], TypeError), ([None], TypeError), ({"a": 1}, TypeError), (3, TypeError),
    (["x"] * 2049, ValueError),
])
def test_bad_texts_are_refused_with_their_position(texts: object, error: type) -> None:
    with pytest.raises(error):
        check_texts(texts)


def test_good_texts() -> None:
    assert check_texts([]) == ()
    assert check_texts(("a", "")) == ("a", "")
    assert len(check_texts(["x"] * 2048)) == 2048



class _FakeEncoder:
    """Stands in for the MLX encoder: each call advances a fake clock by ``cost`` seconds."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self.clock, self.cost = clock, cost

    def encode(self, texts: list[str]) -> SimpleNamespace:
        self.clock[0] += self.cost
        return SimpleNamespace(vectors=np.zeros((len(texts), 4), np.float32),
                               lengths=tuple(1 for _ in texts))


def _service(share: float, cost: float) -> EmbeddingService:
    clock = [0.0]
    encoder = _FakeEncoder(clock, cost)
    return EmbeddingService(window=0.0, max_batch=4, share=share, clock=lambda: clock[0],
                            load_encoder=lambda path: encoder)  # type: ignore[arg-type,return-value]


def _batches_run(service: EmbeddingService, turns: int, step_seconds: float) -> int:
    for i in range(turns):  # a steady load: a request is always waiting
        if not service.pending:
            service.add(request(4, 0.0, request_id=i))
        service.run_due(step_seconds)
    return service.counters.batches


def test_beside_decoding_the_encoder_gets_its_share_of_the_thread() -> None:
    # A batch costs 0.3 s (fake clock), a decode step 0.1 s: at share 0.5 the encoder runs
    # one turn in three, so its time matches the decode steps' to within one batch.
    capped = _service(share=0.5, cost=0.3)
    assert _batches_run(capped, 40, 0.1) == 14
    assert abs(capped.counters.seconds - 40 * 0.1) <= 0.3 + 1e-9
    quarter = _service(share=0.25, cost=0.3)  # a third of the decode steps' time
    assert abs(_batches_run(quarter, 90, 0.1) * 0.3 - 90 * 0.1 / 3) <= 0.3 + 1e-9
    assert _batches_run(_service(share=1.0, cost=0.3), 40, 0.1) == 40  # uncapped


def test_with_no_row_decoding_embeddings_run_every_turn() -> None:
    assert _batches_run(_service(share=0.5, cost=0.3), 10, 0.0) == 10


class _IndexEncoder:
    """Each text ``t<i>`` becomes the vector ``[i, i]`` (so order is checkable), one token
    per character; records each call's texts and can run ``during`` inside a call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.during: Callable[[], None] | None = None

    def encode(self, texts: list[str]) -> SimpleNamespace:
        self.calls.append(list(texts))
        if self.during is not None:
            self.during()
        vectors = np.array([[float(t[1:])] * 2 for t in texts], np.float32).reshape(-1, 2)
        return SimpleNamespace(vectors=vectors, lengths=tuple(len(t) for t in texts))


def _indexed(max_batch: int, now: list[float] | None = None
             ) -> tuple[EmbeddingService, _IndexEncoder]:
    clock = now if now is not None else [0.0]
    encoder = _IndexEncoder()
    service = EmbeddingService(window=0.0, max_batch=max_batch, now=lambda: clock[0],
                               load_encoder=lambda path: encoder)  # type: ignore[arg-type,return-value]
    return service, encoder


def _run_to_end(service: EmbeddingService, limit: int = 100) -> int:
    turns = 0
    while service.pending and turns < limit:
        service.run_due()
        turns += 1
    return turns


def test_a_split_request_runs_one_chunk_per_turn_and_equals_the_unsplit_run() -> None:
    split, chunks = _indexed(max_batch=4)
    whole, _ = _indexed(max_batch=64)
    big = request(10, 0.0)
    split.add(big)
    assert _run_to_end(split) == 3  # 4 + 4 + 2 texts, one encoder call per turn
    assert [len(call) for call in chunks.calls] == [4, 4, 2]
    alone = request(10, 0.0)
    whole.add(alone)
    _run_to_end(whole)
    got, want = big.outcome(), alone.outcome()
    np.testing.assert_array_equal(got.vectors, want.vectors)  # in order, every text once
    np.testing.assert_array_equal(got.vectors[:, 0], np.arange(10))
    assert got.prompt_tokens == want.prompt_tokens == 20
    counters = split.counters
    assert (counters.requests, counters.texts, counters.batches) == (1, 10, 3)
    assert counters.peak_batch_texts == 4 and not split.part_run


def test_the_handle_finishes_only_with_the_last_chunk() -> None:
    service, _ = _indexed(max_batch=4)
    big = request(9, 0.0)
    service.add(big)
    service.run_due()
    service.run_due()
    assert not big.finished
    service.run_due()
    assert big.finished and big.outcome().vectors.shape == (9, 2)


def test_cancelled_between_chunks_the_rest_never_runs() -> None:
    service, encoder = _indexed(max_batch=4)
    big, later = request(12, 0.0), request(1, 0.0, request_id=2)
    service.add(big)
    service.add(later)
    service.run_due()
    big.cancel()
    _run_to_end(service)
    assert encoder.calls == [["t0", "t1", "t2", "t3"], ["t0"]]  # then the next request
    with pytest.raises(RequestCancelledError):
        big.outcome()
    assert later.outcome().vectors.shape == (1, 2)
    assert (service.counters.cancelled, service.counters.requests) == (1, 1)
    assert not service.part_run


def test_timed_out_between_chunks_the_rest_never_runs() -> None:
    now = [0.0]
    service, encoder = _indexed(max_batch=4, now=now)
    big = request(12, 0.0, deadline=1.0)
    service.add(big)
    service.run_due()
    now[0] = 1.0  # the deadline passes between two turns
    _run_to_end(service)
    assert len(encoder.calls) == 1
    with pytest.raises(RequestTimeoutError):
        big.outcome()
    assert service.counters.cancelled == 1 and not service.pending


def test_cancelled_while_its_chunk_runs_its_vectors_and_rest_are_dropped() -> None:
    service, encoder = _indexed(max_batch=4)
    big = request(12, 0.0)
    service.add(big)

    def cancel() -> None:  # the caller cancels while the encoder runs
        big.cancel()

    encoder.during = cancel
    service.run_due()
    assert not service.pending and not service.part_run  # nothing of it is left to run
    _run_to_end(service)
    assert len(encoder.calls) == 1 and service.counters.cancelled == 1
    with pytest.raises(RequestCancelledError):
        big.outcome()


def test_a_failed_chunk_fails_the_request_and_drops_its_rest() -> None:
    service, encoder = _indexed(max_batch=4)
    big = request(12, 0.0)
    service.add(big)
    service.run_due()

    def fail() -> None:
        raise RuntimeError("encoder broke")

    encoder.during = fail
    service.run_due()
    _run_to_end(service)
    assert len(encoder.calls) == 2 and not service.pending and not service.part_run
    with pytest.raises(RuntimeError, match="encoder broke"):
        big.outcome()
    assert (service.counters.failed, service.counters.cancelled) == (1, 0)


def test_beside_decoding_a_split_request_runs_within_the_share() -> None:
    # The chunks of one 40-text request are batches like any other: at share 0.5, with a
    # chunk costing 0.3 s and a step 0.1 s (fake clock), one turn in three runs a chunk.
    capped = _service(share=0.5, cost=0.3)
    big = request(40, 0.0)
    capped.add(big)
    turns = 0
    while not big.finished:
        capped.run_due(0.1)
        turns += 1
    assert capped.counters.batches == 10 and turns > 20
    assert abs(capped.counters.seconds - turns * 0.1) <= 0.3 + 1e-9
    uncapped = _service(share=1.0, cost=0.3)
    uncapped.add(request(40, 0.0))
    assert _batches_run(uncapped, 10, 0.1) == 10  # a chunk every turn


def test_fail_registered_finishes_requests_from_another_thread_without_the_batcher() -> None:
    service, _ = _indexed(max_batch=4)
    waiting, big, done = request(1, 0.0), request(9, 0.0, request_id=2), request(1, 0.0)
    for r in (waiting, big, done):
        service.register(r)
    done.finish(Embeddings(np.zeros((1, 2), np.float32), 1, "a"))
    service.add(big)
    service.run_due()  # big is part-run: a chunk's vectors held, its rest in the batcher
    service.add(waiting)
    failed: list[int] = []
    dead = EngineDeadError("a rank stopped answering")
    worker = threading.Thread(target=lambda: failed.append(service.fail_registered(dead)))
    worker.start()
    worker.join(10)
    assert failed == [2]  # the finished one is left as it was
    for r in (waiting, big):
        with pytest.raises(EngineDeadError):
            r.outcome()
    assert len(service.batcher) == 2  # engine-thread state: untouched by that thread
    _run_to_end(service)  # the engine thread later finds them finished and drops them
    assert not service.pending and not service.part_run
    assert service.counters.cancelled == 0 and service.counters.requests == 0
