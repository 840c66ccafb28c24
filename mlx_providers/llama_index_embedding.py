"""``MLXBatchEmbedding``: a LlamaIndex ``BaseEmbedding`` on the process's shared MLX engine.

Index building (``get_text_embedding_batch``) and concurrent query engines' query
embeddings become batches on the engine thread, between the decode steps of the
``MLXBatchLLM`` answering them. Texts past ``max_seq_length`` (256 tokens for the default
all-MiniLM-L6-v2) are truncated.
"""

from __future__ import annotations

import os
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field

from engine import embedding_model_name
from mlx_providers._embeddings import aembed, check_model, check_query, embed


class MLXBatchEmbedding(BaseEmbedding):
    """Local sentence embeddings for LlamaIndex (unit vectors). Example::

        Settings.embed_model = MLXBatchEmbedding()  # all-MiniLM-L6-v2, downloaded once
        index = VectorStoreIndex.from_documents(documents)
    """

    model: str | None = Field(
        default=None, description="A sentence-transformers (BERT) directory, a hub id, or "
        "None for all-MiniLM-L6-v2.")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds after which a request is dropped.")
    embed_batch_size: int = Field(default=64, gt=0, le=2048,
                                  description="Texts per engine request.")

    def __init__(self, model: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        """Validate the settings; the model loads on the engine thread at first use."""
        spec = check_model(model)
        kwargs.setdefault("model_name", embedding_model_name(spec))
        kwargs["model"] = spec
        super().__init__(**kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "MLXBatchEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed([check_query(query)], self.model, self.timeout)[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await aembed([check_query(query)], self.model, self.timeout))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return embed([check_query(text)], self.model, self.timeout)[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await aembed([check_query(text)], self.model, self.timeout))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return embed(texts, self.model, self.timeout)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await aembed(texts, self.model, self.timeout)
