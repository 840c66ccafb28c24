"""``MLXBatchEmbeddings``: LangChain ``Embeddings`` on the process's shared MLX engine.

Calls from any thread or event loop are batched together on the engine thread (and run
between the decode steps of any chat model there). Texts past the model's
``max_seq_length`` (256 tokens for the default all-MiniLM-L6-v2) are truncated.
"""

from __future__ import annotations

import os
from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_providers._embeddings import aembed, check_model, check_query, embed


class MLXBatchEmbeddings(BaseModel, Embeddings):
    """Local sentence embeddings (unit vectors, cosine = dot product). Example::

        embeddings = MLXBatchEmbeddings()  # all-MiniLM-L6-v2, downloaded once
        vectors = embeddings.embed_documents(["first text", "second text"])
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """A local sentence-transformers (BERT) directory, a hub id, or None for the default,
    all-MiniLM-L6-v2."""
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Seconds after which a request is dropped and ``RequestTimeoutError`` raised."""

    @field_validator("model", mode="before")
    @classmethod
    def _model_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector per text; ``[]`` for no texts."""
        return embed(texts, check_model(self.model), self.timeout)

    def embed_query(self, text: str) -> list[float]:
        return embed([check_query(text)], check_model(self.model), self.timeout)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """Native async: awaits the engine without a worker thread per call."""
        return await aembed(texts, check_model(self.model), self.timeout)

    async def aembed_query(self, text: str) -> list[float]:
        return (await aembed([check_query(text)], check_model(self.model), self.timeout))[0]
