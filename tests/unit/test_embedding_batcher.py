"""The embedding batcher, the share policy and the checks on texts: no model, no mlx."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine import RequestCancelledError, RequestTimeoutError, check_texts
from engine.embedding_batcher import EmbeddingBatcher
from engine.embedding_service import EmbeddingService
from engine.embeddings import EmbeddingRequest

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


def test_a_request_larger_than_max_batch_runs_alone_unsplit() -> None:
    batcher = EmbeddingBatcher(window=10.0, max_batch=4)
    big, small = request(9, 0.0), request(1, 0.0)
    batcher.add(A, big)
    batcher.add(A, small)
    batch = batcher.take(0.0)
    assert batch is not None and batch.requests == [big]


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
    service = EmbeddingService(window=0.0, max_batch=4, share=share, clock=lambda: clock[0])
    service._encoders[A] = _FakeEncoder(clock, cost)  # type: ignore[assignment]
    return service


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
