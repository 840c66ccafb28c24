"""``POST /v1/embeddings`` through the real ``openai`` SDK over loopback, its errors, its
admission (429 past capacity) and clients that disconnect (their requests cancelled)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from engine import Engine, EngineConfig, StepProbe
from mlx_providers.server import ServerSettings, create_app
from mlx_providers.server.cli import embedding_models, parser
from tests.conftest import HeldEmbeddings, wait_until
from tests.server.conftest import LiveServer

NAME = "all-MiniLM-L6-v2"
PAIR = ["A man is eating food.", "A man is eating a piece of bread."]


@pytest.fixture(scope="module")
def server(server_engine: Engine, embedding_model_dir: Path) -> Iterator[LiveServer]:
    """The tiny chat model as ``tiny`` and the default embedding model beside it."""
    live = LiveServer(create_app({"tiny": server_engine}, embeddings={NAME: None})).start()
    yield live
    live.stop()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_the_sdk_gets_the_documented_pair(client: openai.OpenAI) -> None:
    # The SDK asks for base64 unless told otherwise and decodes it itself.
    response = client.embeddings.create(model=NAME, input=PAIR)
    a, b = (np.array(d.embedding) for d in response.data)
    assert [d.index for d in response.data] == [0, 1] and response.model == NAME
    assert float(a @ b) == pytest.approx(0.7553, abs=0.0005)
    assert response.usage.prompt_tokens == response.usage.total_tokens == 19


def test_float_and_base64_agree_with_the_engine(client: openai.OpenAI, server_engine: Engine,
                                                embedding_model_dir: Path) -> None:
    floats = client.embeddings.create(model=NAME, input=PAIR, encoding_format="float")
    packed = client.embeddings.create(model=NAME, input=PAIR, encoding_format="base64")
    local = server_engine.embed(PAIR, embedding_model_dir).result(timeout=60).vectors
    for f, p, want in zip(floats.data, packed.data, local, strict=True):
        np.testing.assert_array_equal(np.array(f.embedding, np.float32), want)
        assert isinstance(p.embedding, str)  # asked for explicitly, the SDK leaves it packed
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(p.embedding), "<f4"), want)


def test_metrics_count_the_embeddings(client: openai.OpenAI, server: LiveServer,
                                      server_engine: Engine) -> None:
    """/metrics exports the engine's embedding counters beside its chat ones."""
    from tests.server.test_metrics_and_cli import scrape

    model = (("model", "tiny"),)
    before = scrape(server).get(("mlx_engine_embed_texts_total", model), 0.0)
    client.embeddings.create(model=NAME, input=PAIR)
    # The service's counters reach stats() at the end of the engine's turn.
    wait_until(lambda: server_engine.stats().embed_texts >= before + 2)
    metrics = scrape(server)
    stats = server_engine.stats()
    assert metrics[("mlx_engine_embed_texts_total", model)] == stats.embed_texts == before + 2
    assert metrics[("mlx_engine_embed_requests_total", model)] == stats.embed_requests >= 1
    assert metrics[("mlx_engine_embed_batches_total", model)] == stats.embed_batches >= 1
    assert metrics[("mlx_engine_embed_tokens_total", model)] == stats.embed_tokens > 0


def test_a_string_input_gives_one_vector(client: openai.OpenAI) -> None:
    response = client.embeddings.create(model=NAME, input="just one")
    assert len(response.data) == 1 and len(response.data[0].embedding) == 384


def test_models_lists_the_embedding_model(client: openai.OpenAI) -> None:
    assert {m.id for m in client.models.list()} == {"tiny", NAME}


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": NAME, "input": ""}, 400, "input"),
    ({"model": NAME, "input": []}, 400, "input"),
    ({"model": NAME, "input": ["ok", ""]}, 400, "input"),
    ({"model": NAME, "input": [1, 2, 3]}, 400, "input"),
    ({"model": NAME, "input": [[1, 2]]}, 400, "input"),
    ({"model": NAME, "input": ["ok", None]}, 400, "input"),
    ({"model": NAME, "input": {"text": "x"}}, 400, "input"),
    ({"model": NAME, "input": ["x"] * 2049}, 400, "input"),
    ({"model": NAME}, 400, "input"),
    ({"input": "x"}, 400, "model"),
    ({"model": NAME, "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": NAME, "input": "x", "dimensions": 64}, 400, "dimensions"),
    ({"model": "tiny", "input": "x"}, 404, "model"),
    ({"model": "nope", "input": "x"}, 404, "model"),
])
def test_bad_requests_are_4xx_naming_the_parameter(server: LiveServer, body: dict[str, object],
                                                   status: int, param: str) -> None:
    response = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


async def test_embeddings_and_chat_streams_share_the_engine(server: LiveServer) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Say something"}]

    async def chat() -> str:
        reply = await client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=12, temperature=0)
        return reply.choices[0].message.content or ""

    alone = await chat()
    results = await asyncio.gather(
        *(chat() for _ in range(3)),
        *(client.embeddings.create(model=NAME, input=PAIR) for _ in range(3)))
    assert results[:3] == [alone] * 3
    assert all(len(r.data) == 2 for r in results[3:])  # type: ignore[union-attr]


def test_the_cli_serves_the_default_embedding_model_unless_told_not_to(tmp_path: Path) -> None:
    assert embedding_models(None) == {NAME: None}
    assert embedding_models("none") == {}
    assert embedding_models(str(tmp_path)) == {tmp_path.name: str(tmp_path)}
    args = parser().parse_args(["serve", "--embedding-model", "none"])
    assert args.embedding_model == "none"
    assert parser().parse_args(["serve"]).embedding_model is None


@pytest.fixture
def held(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, Engine, HeldEmbeddings]]:
    """A fresh engine (one text per batch, so capacity is 1 + max_queue) and server, its
    embedding batches held (``HeldEmbeddings``: each call is recorded, then waits for
    ``go``); ``max_queue=0``: one embedding request in flight at a time."""
    encoder = HeldEmbeddings()
    eng = Engine(tiny_model_dir, EngineConfig(embed_window=0.0, embed_max_batch=1),
                 probe=StepProbe(on_embed=encoder))
    live = LiveServer(create_app({"tiny": eng}, settings=ServerSettings(max_queue=0),
                                 embeddings={NAME: None})).start()  # warms the encoder up
    encoder.armed = True
    try:
        yield live, eng, encoder
    finally:
        encoder.go.set()
        live.stop()
        eng.close()


def leaving_client(server: LiveServer, body: dict[str, object]) -> socket.socket:
    """A client that sends its request and leaves whenever the test closes the socket."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(data) + data)
    return sock


def in_flight(server: LiveServer) -> int:
    return int(server.app.state.ctx.embeddings[NAME].admission.in_flight)  # type: ignore[attr-defined]


def test_a_client_that_leaves_while_its_batch_runs_cancels_it(
        held: tuple[LiveServer, Engine, HeldEmbeddings]) -> None:
    server, eng, encoder = held
    before = eng.stats()
    sock = leaving_client(server, {"model": NAME, "input": ["left while it ran"]})
    assert encoder.started.wait(30)  # its batch is in the encoder now
    sock.close()
    wait_until(lambda: in_flight(server) == 0)  # the handler saw the disconnect, cancelled
    encoder.go.set()
    wait_until(lambda: eng.stats().embed_cancelled == before.embed_cancelled + 1)
    after = eng.stats()
    assert encoder.calls == [["left while it ran"]]
    assert after.embed_requests == before.embed_requests  # its vectors were dropped


def test_a_client_that_leaves_while_its_request_waits_cancels_it_unrun(
        held: tuple[LiveServer, Engine, HeldEmbeddings]) -> None:
    server, eng, encoder = held
    server.app.state.ctx.embeddings[NAME].admission.capacity = 2  # type: ignore[attr-defined]
    before = eng.stats()
    answers: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.base_url}/embeddings", json={"model": NAME, "input": ["holds the engine"]},
        timeout=60)))
    holder.start()
    assert encoder.started.wait(30)  # the engine thread is busy with the holder's batch
    sock = leaving_client(server, {"model": NAME, "input": ["never embedded"]})
    wait_until(lambda: in_flight(server) == 2)
    sock.close()
    wait_until(lambda: in_flight(server) == 1)  # its handler cancelled it and returned
    encoder.go.set()
    holder.join(60)
    assert answers and answers[0].status_code == 200
    wait_until(lambda: eng.stats().embed_cancelled == before.embed_cancelled + 1)
    assert encoder.calls == [["holds the engine"]]  # the one that left never ran
    assert eng.stats().embed_requests == before.embed_requests + 1


def test_past_capacity_embeddings_are_429_with_retry_after(
        held: tuple[LiveServer, Engine, HeldEmbeddings]) -> None:
    server, _, encoder = held
    assert server.app.state.ctx.embeddings[NAME].admission.capacity == 1  # type: ignore[attr-defined]
    body = {"model": NAME, "input": ["first"]}
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.base_url}/embeddings", json=body, timeout=60)))
    first.start()
    assert encoder.started.wait(30)
    refused = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=30)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert server.app.state.ctx.models.get("tiny").in_flight == 0  # type: ignore[attr-defined]
    encoder.go.set()
    first.join(60)
    assert answers and answers[0].status_code == 200
    wait_until(lambda: in_flight(server) == 0)
    again = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=60)
    assert again.status_code == 200  # the slot came back
