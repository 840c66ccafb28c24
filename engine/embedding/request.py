"""An embedding request, its handle, and the checks on its texts (no mlx).

The caller builds an ``EmbeddingRequest``, the engine thread finishes it with vectors or
an error; whoever finishes it first wins. Cancelling or timing out finishes it on the
caller's side at once, so nobody waits on the engine, and the engine then skips it (or
drops its vectors when it was already running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from engine.core.waiters import Waiters, is_cancellation
from engine.errors import RequestCancelledError, RequestTimeoutError

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings endpoint allows


def check_texts(texts: Any, *, max_inputs: int = MAX_INPUTS) -> tuple[str, ...]:
    """``texts`` as a tuple of strings, or a ``TypeError``/``ValueError`` saying what is wrong.

    A lone ``str`` is refused (it is a sequence of characters, almost never meant as one);
    an empty list is fine (no vectors); empty strings are embedded (the model's [CLS][SEP]).
    """
    if isinstance(texts, str | bytes | bytearray):
        raise TypeError(f"texts must be a list of strings, got a single "
                        f"{type(texts).__name__}; wrap it in a list or use embed_query")
    if not isinstance(texts, list | tuple):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
    if len(texts) > max_inputs:
        raise ValueError(f"{len(texts)} texts in one request; at most {max_inputs} are "
                         f"accepted (split them)")
    return tuple(texts)


@dataclass(frozen=True)
class Embeddings:
    """One unit vector per text (``vectors[i]`` is float32), in the order given."""

    vectors: np.ndarray
    prompt_tokens: int  # tokens after truncation, [CLS] and [SEP] included
    model: str

    def tolist(self) -> list[list[float]]:
        return [[float(x) for x in row] for row in self.vectors]


@dataclass(eq=False)
class EmbeddingRequest:
    """Texts for one embedding model, from submission until finished (thread-safe)."""

    request_id: int
    texts: tuple[str, ...]
    model_path: Path  # the resolved embedding model directory (what the batcher groups by)
    model_name: str
    submitted_at: float
    deadline: float | None = None
    _waiters: Waiters = field(default_factory=Waiters, repr=False)
    _finished: bool = field(default=False, repr=False)
    _result: Embeddings | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return self._finished

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def finish(self, result: Embeddings | None = None,
               error: BaseException | None = None) -> bool:
        """Set the outcome once (any thread); False when it was already finished."""
        with self._waiters.changing():
            if self._finished:
                return False
            self._result, self._error = result, error
            self._finished = True
        return True

    def cancel(self, error: BaseException | None = None) -> bool:
        """Finish as cancelled (with ``error``, e.g. a timeout); the engine skips it."""
        self.cancelled = True
        return self.finish(error=error or RequestCancelledError(
            f"embedding request {self.request_id} was cancelled"))

    def time_out(self) -> None:
        self.cancel(RequestTimeoutError(f"embedding request {self.request_id} timed out "
                                        f"after {(self.deadline or 0) - self.submitted_at:.3g} s"))

    def outcome(self) -> Embeddings:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def wait(self, timeout: float | None) -> None:
        """Block until finished; ``TimeoutError`` when ``timeout`` seconds pass first."""
        self._waiters.wait(self._is_finished, lambda: None, timeout,
                           "the embeddings were not ready within the wait timeout")

    async def wait_async(self) -> None:
        """Await the request's end without blocking the event loop."""
        await self._waiters.wait_async(self._is_finished, lambda: None)

    def _is_finished(self) -> bool:
        return self._finished


class EmbeddingHandle:
    """A submitted embedding request: wait with ``result()`` or ``await aresult()``.

    ``cancel()``, a timeout, or cancelling the task awaiting ``aresult()`` finishes it at
    once with an error; the engine never runs it then, or drops its vectors.
    """

    def __init__(self, request: EmbeddingRequest) -> None:
        self._request = request

    @property
    def request_id(self) -> int:
        return self._request.request_id

    @property
    def done(self) -> bool:
        return self._request.finished

    def cancel(self) -> None:
        self._request.cancel()

    def result(self, timeout: float | None = None) -> Embeddings:
        """Block until the vectors are ready; raise the request's error otherwise."""
        request = self._request
        wait = timeout
        if request.deadline is not None:
            left = max(0.0, request.deadline - time.monotonic())
            wait = left if wait is None else min(wait, left)
        try:
            request.wait(wait)
        except TimeoutError:
            if not request.expired(time.monotonic()):
                raise
            request.time_out()  # its own deadline passed: the request's error, not ours
        return request.outcome()

    async def aresult(self) -> Embeddings:
        """Await the vectors; cancelling the awaiting task cancels the request."""
        request = self._request
        try:
            if request.deadline is None:
                await request.wait_async()
            else:
                with anyio.move_on_after(max(0.0, request.deadline - time.monotonic())):
                    await request.wait_async()
                if not request.finished:
                    request.time_out()
        except BaseException as exc:
            if is_cancellation(exc):
                request.cancel()
            raise
        return request.outcome()
