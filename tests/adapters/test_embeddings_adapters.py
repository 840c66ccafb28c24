"""``MLXBatchEmbeddings`` (LangChain, with its standard suites) and ``MLXBatchEmbedding``
(LlamaIndex) on the process's embedding engine, with the default all-MiniLM-L6-v2."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.embeddings import Embeddings
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from engine import get_embedding_engine
from mlx_providers import MLXBatchEmbedding, MLXBatchEmbeddings

PAIR = ["A man is eating food.", "A man is eating a piece of bread."]


@pytest.fixture(autouse=True)
def _default_model(embedding_model_dir: Path) -> None:
    """Every test here needs the default embedding model (skips with why when offline)."""


class TestMLXBatchEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[Embeddings]:
        return MLXBatchEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {}


class TestMLXBatchEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[Embeddings]:
        return MLXBatchEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {}


def test_langchain_query_and_documents_agree() -> None:
    embeddings = MLXBatchEmbeddings()
    query = embeddings.embed_query(PAIR[0])
    documents = embeddings.embed_documents(PAIR)
    np.testing.assert_allclose(query, documents[0], atol=2e-6)
    assert float(np.dot(documents[0], documents[1])) == pytest.approx(0.7553, abs=0.0005)
    assert embeddings.embed_documents([]) == []


async def test_langchain_async_calls_batch_together() -> None:
    embeddings = MLXBatchEmbeddings()
    sync = embeddings.embed_documents(PAIR)
    host = get_embedding_engine()
    before = host.stats().embed_batches
    got = await asyncio.gather(*(embeddings.aembed_query(t) for t in PAIR * 4))
    assert host.stats().embed_batches - before < len(got)  # several calls per batch
    for i, vector in enumerate(got):
        np.testing.assert_allclose(vector, sync[i % 2], atol=2e-6)
    assert await embeddings.aembed_documents([]) == []


@pytest.mark.parametrize(("call", "value", "error"), [
    ("embed_documents", "a string", TypeError), ("embed_documents", [b"bytes"], TypeError),
    ("embed_documents", ["ok", 1], TypeError), ("embed_documents", ["x"] * 2049, ValueError),
    ("embed_query", ["a list"], TypeError), ("embed_query", b"bytes", TypeError),
    ("embed_query", None, TypeError)])
def test_langchain_bad_input(call: str, value: Any, error: type) -> None:
    with pytest.raises(error):
        getattr(MLXBatchEmbeddings(), call)(value)


async def test_langchain_async_bad_input() -> None:
    with pytest.raises(TypeError):
        await MLXBatchEmbeddings().aembed_documents("a string")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await MLXBatchEmbeddings().aembed_query(["a list"])  # type: ignore[arg-type]


def test_langchain_bad_settings() -> None:
    with pytest.raises(ValueError):
        MLXBatchEmbeddings(timeout=-1)
    with pytest.raises(ValueError):
        MLXBatchEmbeddings(unknown=1)  # type: ignore[call-arg]


async def test_llama_index_text_query_batch_and_async() -> None:
    embed = MLXBatchEmbedding(embed_batch_size=3)
    assert embed.model_name == "all-MiniLM-L6-v2"
    texts = [*PAIR, "a third text", "a fourth", "a fifth"]
    batch = embed.get_text_embedding_batch(texts)
    abatch = await embed.aget_text_embedding_batch(texts)
    assert len(batch) == len(abatch) == 5
    np.testing.assert_allclose(batch, abatch, atol=2e-6)
    np.testing.assert_allclose(embed.get_text_embedding(PAIR[0]), batch[0], atol=2e-6)
    np.testing.assert_allclose(embed.get_query_embedding(PAIR[1]), batch[1], atol=2e-6)
    np.testing.assert_allclose(await embed.aget_query_embedding(PAIR[1]), batch[1], atol=2e-6)
    np.testing.assert_allclose(await embed.aget_text_embedding(PAIR[0]), batch[0], atol=2e-6)
    assert embed.similarity(batch[0], batch[1]) == pytest.approx(0.7553, abs=0.0005)


def test_llama_index_bad_input(tmp_path: Path) -> None:
    embed = MLXBatchEmbedding()
    with pytest.raises(TypeError):
        embed.get_query_embedding(["a list"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        embed.get_text_embedding_batch([b"bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        MLXBatchEmbedding(model=3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        MLXBatchEmbedding(model=tmp_path / "missing").get_query_embedding("x")
    assert MLXBatchEmbedding(model=tmp_path).model_name == tmp_path.name


async def test_llama_index_vector_index_retrieves_the_matching_document() -> None:
    from llama_index.core import Document, VectorStoreIndex

    documents = [Document(text="The engine batches requests from many callers."),
                 Document(text="Bread is baked from flour, water and yeast."),
                 Document(text="The cat sleeps on the warm windowsill.")]
    index = VectorStoreIndex.from_documents(documents, embed_model=MLXBatchEmbedding())
    nodes = await index.as_retriever(similarity_top_k=1).aretrieve("How is bread made?")
    assert "flour" in nodes[0].get_content()
