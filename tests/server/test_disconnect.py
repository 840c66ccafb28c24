"""A client that goes away cancels its row: evidence from the engine's own statistics.

The model is slowed (every batch step sleeps) so each generation is still running when
its client disconnects; without cancellation these rows would run for seconds more.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from engine import Engine, RequestHandle
from tests.conftest import wait_until
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500}
STEP = 0.02  # seconds per batch step: 1500 tokens would take 30 s


@pytest.fixture
def slow_server(serve: Serve, slow_steps: Callable[[float], None]) -> tuple[LiveServer, Engine]:
    slow_steps(STEP)
    return serve()


def assert_stopped_generating(eng: Engine) -> None:
    """No row is running and the token count stays put (nothing generates for nobody)."""
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=10)
    tokens = eng.stats().generated_tokens
    time.sleep(10 * STEP)
    assert eng.stats().generated_tokens == tokens


def test_closing_a_chat_stream_evicts_its_row(slow_server: tuple[LiveServer, Engine]) -> None:
    server, eng = slow_server
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
        assert eng.stats().running == 1
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    stats = eng.stats()
    assert stats.completed == 0 and stats.generated_tokens < 200


def test_a_non_streaming_client_that_times_out_evicts_its_row(
        slow_server: tuple[LiveServer, Engine]) -> None:
    server, eng = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=0.6)
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    assert eng.stats().completed == 0 and eng.stats().generated_tokens < 200


def test_a_queued_request_whose_client_leaves_is_never_prefilled(
        serve: Serve, slow_steps: Callable[[float], None]) -> None:
    slow_steps(STEP)
    server, eng = serve(max_batch=1)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    running = client.chat.completions.create(stream=True, **LONG)  # type: ignore[call-overload]
    next(iter(running))
    wait_until(lambda: eng.stats().running == 1)
    admitted = eng.stats().prompt_tokens  # the running row's prompt
    queued = {**LONG, "messages": [{"role": "user", "content": "a different question " * 5}]}
    gave_up: list[BaseException] = []

    def impatient() -> None:
        try:
            httpx.post(server.url + "/v1/chat/completions", json=queued, timeout=0.5)
        except httpx.ReadTimeout as exc:
            gave_up.append(exc)

    thread = threading.Thread(target=impatient)
    thread.start()
    wait_until(lambda: eng.stats().pending == 1)
    thread.join(10)
    assert gave_up
    wait_until(lambda: eng.stats().cancelled == 1 and eng.stats().pending == 0)
    assert eng.stats().running == 1  # the first row goes on
    assert eng.stats().prompt_tokens == admitted  # the queued prompt was never prefilled
    running.close()
    wait_until(lambda: eng.stats().cancelled == 2)
    assert_stopped_generating(eng)
    assert eng.stats().prompt_tokens == admitted


def test_a_responses_stream_closed_by_its_reader_cancels_and_is_stored_cancelled(
        slow_server: tuple[LiveServer, Engine]) -> None:
    server, eng = slow_server
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    stream = client.responses.create(model="tiny", input="hi", max_output_tokens=1500,
                                     stream=True)
    response_id = None
    deltas = 0
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        deltas += event.type == "response.output_text.delta"
        if deltas == 5:
            break
    stream.close()
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    assert response_id is not None
    stored = client.responses.retrieve(response_id)
    assert stored.status == "cancelled"
    assert stored.output and stored.output_text  # what was generated before the close


def test_every_slot_is_released_after_disconnects(
        slow_server: tuple[LiveServer, Engine]) -> None:
    """Admission slots come back however requests end (else the server would 429 forever)."""
    server, eng = slow_server
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                          json={**LONG, "stream": True}) as response:
            next(response.iter_lines())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=0.3)
    wait_until(lambda: eng.stats().cancelled == 4, timeout=10)
    served = server.app.state.ctx.models.get("tiny")  # type: ignore[attr-defined]
    wait_until(lambda: served.in_flight == 0, timeout=10)


@pytest.fixture
def cancel_commands(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The request id of every Cancel a handle sends to the engine, in order.

    Counted where a handle hands its cancel to the engine (the callable it is built with),
    so every route counts: the server's own close, the engine iterator's, a GC'd one.
    """
    sent: list[int] = []
    built = RequestHandle.__init__

    def counting(self: RequestHandle, request_id: int, stream: Any,
                 cancel: Callable[[], None]) -> None:
        def send() -> None:
            sent.append(request_id)
            cancel()

        built(self, request_id, stream, send)

    monkeypatch.setattr(RequestHandle, "__init__", counting)
    return sent


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_dropping_mid_stream_cancels_its_row_exactly_once(
        slow_server: tuple[LiveServer, Engine], cancel_commands: list[int], path: str) -> None:
    server, eng = slow_server
    body = ({**LONG, "stream": True} if path.endswith("completions") else
            {"model": "tiny", "input": "hi", "max_output_tokens": 1500, "stream": True})
    with httpx.stream("POST", server.url + path, timeout=30, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(12):  # well into the generation
            next(lines)
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    gc.collect()  # an iterator dropped without closing would cancel now
    time.sleep(0.2)
    assert len(cancel_commands) == 1, cancel_commands


def test_a_non_streaming_client_leaving_cancels_its_row_exactly_once(
        slow_server: tuple[LiveServer, Engine], cancel_commands: list[int]) -> None:
    server, eng = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=0.6)
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    gc.collect()
    time.sleep(0.2)
    assert len(cancel_commands) == 1, cancel_commands
