"""``POST /v1/embeddings`` through the real ``openai`` SDK over loopback, and its errors."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from engine import Engine
from mlx_providers.server import create_app
from mlx_providers.server.cli import embedding_models, parser
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
