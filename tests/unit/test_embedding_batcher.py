"""The embedding batcher and the checks on texts: pure, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import RequestCancelledError, RequestTimeoutError, check_texts
from engine.embedding_batcher import EmbeddingBatcher
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
