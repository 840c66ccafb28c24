"""The models a server was started with, by name, and each one's bounded admission.

A request's ``model`` is looked up here and nowhere else: it can only name a model the
server holds, never a path or hub id to load. Each model admits at most ``max_batch +
max_queue`` requests at once (an embedding model ``embed_max_batch + max_queue``: what
one batch runs, plus the queue); past that the client gets 429 with ``Retry-After``
instead of an ever-growing queue.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from engine import Engine, TokenText, token_texts
from mlx_providers.server.errors import APIError


class Admission:
    """At most ``capacity`` requests of one served model in flight (thread-safe)."""

    def __init__(self, name: str, capacity: int, retry_after_seconds: int = 1) -> None:
        self.name = name
        self.capacity = capacity
        self.retry_after_seconds = retry_after_seconds
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self) -> Slot:
        """A slot for one request, or 429 with ``Retry-After`` when the model is full."""
        with self._lock:
            if self._in_flight >= self.capacity:
                raise APIError(429, f"the server is at capacity for model {self.name!r} "
                               f"({self.capacity} requests in flight); retry later",
                               type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(self.retry_after_seconds)})
            self._in_flight += 1
        return Slot(self)

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1


class Slot:
    """One admitted request; ``release`` is idempotent (streams and handlers both call it)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.release()

    def __del__(self) -> None:
        # A stream body that was never iterated (the client left first) still frees it.
        self.release()


@dataclass(eq=False)
class ServedModel:
    """One engine served under ``name``; admits ``max_batch + max_queue`` requests."""

    name: str
    engine: Engine
    max_queue: int = 64
    retry_after_seconds: int = 1
    admission: Admission = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.name, self.engine.config.max_batch + self.max_queue,
                                   self.retry_after_seconds)

    @property
    def capacity(self) -> int:
        return self.admission.capacity

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def admit(self) -> Slot:
        """A slot for one request, or 429 when the model's queue is full."""
        return self.admission.admit()

    @cached_property
    def _token_text(self) -> TokenText:
        return token_texts(self.engine.tokenizer)

    def token_text(self, token_id: int) -> str:
        """A token's text, for logprobs (``engine.token_texts``: decoded once per id)."""
        return self._token_text(token_id)


class ServedModels:
    """Served models by name; the first is the default for ``/v1/models`` order."""

    def __init__(self, models: Mapping[str, ServedModel]) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self._models = dict(models)

    def __iter__(self) -> Iterator[ServedModel]:
        """Each served model once (a model served under an alias too is one model)."""
        return iter(dict.fromkeys(self._models.values()))

    def engines(self) -> dict[str, Engine]:
        """Each served model's engine under its own name (its aliases are not counted
        again in the metrics)."""
        return {served.name: served.engine for served in self}

    def serves(self, name: str) -> bool:
        return name in self._models

    def get(self, name: str, param: str = "model") -> ServedModel:
        served = self._models.get(name)
        if served is None:
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves "
                           f"{sorted(self._models)}", param=param, code="model_not_found")
        return served


# An embedding model as a server names it: None (all-MiniLM-L6-v2), a path or a hub id.
EmbeddingModel = str | os.PathLike[str] | None


@dataclass(eq=False)
class ServedEmbedding:
    """An embedding model served under ``name``, run by ``engine`` (the chat model's);
    admits ``embed_max_batch + max_queue`` requests at once."""

    name: str
    engine: Engine
    model: EmbeddingModel  # None: all-MiniLM-L6-v2
    max_queue: int = 64
    retry_after_seconds: int = 1
    admission: Admission = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # One batch runs at most embed_max_batch requests; beyond that they queue.
        self.admission = Admission(self.name,
                                   self.engine.config.embed_max_batch + self.max_queue,
                                   self.retry_after_seconds)

    def warm_up(self) -> None:
        """Fetch the model and load its encoder before the first request (blocking)."""
        self.engine.embed(["warm up"], self.model).result()
