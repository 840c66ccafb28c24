"""LangChain's ``ChatOllama``/``OllamaEmbeddings`` and LlamaIndex's ``Ollama`` on the tiny
model through Ollama's API door, unchanged, over loopback. Random weights: structure and
agreement with the engine's own answer, not meaning."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings
from pydantic import BaseModel

from engine import ChatRequest, Engine, SamplingParams
from mlx_providers.server import create_app
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(120)
EMBEDDING = "all-MiniLM-L6-v2"
QUESTION = "Hello there"


@pytest.fixture(scope="module")
def server(server_engine: Engine, embedding_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(create_app({"tiny": server_engine},
                                 embeddings={EMBEDDING: None})).start()
    yield live
    live.stop()


def engine_text(engine: Engine, max_tokens: int) -> str:
    request = ChatRequest.from_openai([{"role": "user", "content": QUESTION}],
                                      SamplingParams(max_tokens=max_tokens))
    return engine.submit(request).result(timeout=60).content


@tool
def pick(colour: Literal["red", "blue"]) -> str:
    """Pick a colour."""
    return f"picked {colour}"


class Pick(BaseModel):
    """A colour and whether it is sure."""

    colour: Literal["red", "blue"]
    sure: bool


def test_chat_ollama_invoke_and_stream(server: LiveServer, server_engine: Engine) -> None:
    llm = ChatOllama(model="tiny", base_url=server.url, num_predict=10)
    message = llm.invoke(QUESTION)
    assert isinstance(message, AIMessage) and message.content == engine_text(server_engine, 10)
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] == 10
    assert message.response_metadata["done_reason"] == "length"
    chunks = list(llm.stream(QUESTION))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(str(c.content) for c in chunks) == message.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == 10


async def test_chat_ollama_async_stream(server: LiveServer, server_engine: Engine) -> None:
    llm = ChatOllama(model="tiny:latest", base_url=server.url, num_predict=8)
    text = "".join([str(c.content) async for c in llm.astream(QUESTION)])
    assert text == engine_text(server_engine, 8)


def test_chat_ollama_bind_tools_renders_the_tools(server: LiveServer) -> None:
    """The random model calls nothing itself (calls out: test_ollama_tool_calls.py); the
    tools reach its prompt."""
    llm = ChatOllama(model="tiny", base_url=server.url, num_predict=4)
    with_tools = llm.bind_tools([pick]).invoke(QUESTION)
    plain = llm.invoke(QUESTION)
    assert isinstance(with_tools, AIMessage)
    assert with_tools.usage_metadata is not None and plain.usage_metadata is not None
    assert with_tools.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"]


def test_chat_ollama_structured_output_validates(server: LiveServer) -> None:
    llm = ChatOllama(model="tiny", base_url=server.url, num_predict=60)
    picked = llm.with_structured_output(Pick).invoke("Pick a colour.")
    assert isinstance(picked, Pick)
    raw = llm.with_structured_output(Pick.model_json_schema(), method="json_schema").invoke(
        "Pick a colour.")
    assert isinstance(raw, dict) and Pick.model_validate(raw) == picked


def test_ollama_embeddings(server: LiveServer, server_engine: Engine,
                           embedding_model_dir: Path) -> None:
    embeddings = OllamaEmbeddings(model=EMBEDDING, base_url=server.url)
    texts = ["The cat sat.", "A dog ran."]
    vectors = np.array(embeddings.embed_documents(texts), np.float32)
    want = server_engine.embed(texts, embedding_model_dir).result(timeout=60).vectors
    np.testing.assert_allclose(vectors, want, rtol=1e-6)
    np.testing.assert_allclose(np.array(embeddings.embed_query("The cat sat."), np.float32),
                               want[0], rtol=1e-6)


def test_llama_index_ollama_chat_and_stream(server: LiveServer, server_engine: Engine) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama

    # context_window left unset: the client reads it from /api/show's model_info.
    llm = Ollama(model="tiny", base_url=server.url, request_timeout=60,
                 additional_kwargs={"num_predict": 9})
    assert llm.metadata.context_window == server_engine.context_limit == 2048
    history = [ChatMessage(role="user", content=QUESTION)]
    response = llm.chat(history)
    assert response.message.content == engine_text(server_engine, 9)
    assert response.raw is not None and response.raw["usage"]["completion_tokens"] == 9
    streamed = list(llm.stream_chat(history))
    assert "".join(r.delta or "" for r in streamed) == response.message.content
    assert streamed[-1].message.content == response.message.content


async def test_llama_index_ollama_async_chat(server: LiveServer, server_engine: Engine) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama

    llm = Ollama(model="tiny", base_url=server.url, request_timeout=60, context_window=2048,
                 additional_kwargs={"num_predict": 7})
    history = [ChatMessage(role="user", content=QUESTION)]
    response = await llm.achat(history)
    assert response.message.content == engine_text(server_engine, 7)
    pieces = [r.delta or "" async for r in await llm.astream_chat(history)]
    assert "".join(pieces) == response.message.content
