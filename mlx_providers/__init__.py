"""LangChain and LlamaIndex integrations on one shared MLX continuous-batching engine.

``ChatMLXBatch`` and ``MLXBatchEmbeddings`` (LangChain, need ``langchain-core``),
``MLXBatchLLM`` and ``MLXBatchEmbedding`` (LlamaIndex, need ``llama-index-core``) are
imported lazily, so either framework alone is enough.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_providers.langchain import ChatMLXBatch
    from mlx_providers.langchain_embeddings import MLXBatchEmbeddings
    from mlx_providers.llama_index import MLXBatchLLM
    from mlx_providers.llama_index_embedding import MLXBatchEmbedding

__all__ = ["ChatMLXBatch", "MLXBatchEmbedding", "MLXBatchEmbeddings", "MLXBatchLLM"]

_HOMES = {"ChatMLXBatch": ("mlx_providers.langchain", "langchain"),
          "MLXBatchEmbeddings": ("mlx_providers.langchain_embeddings", "langchain"),
          "MLXBatchLLM": ("mlx_providers.llama_index", "llama-index"),
          "MLXBatchEmbedding": ("mlx_providers.llama_index_embedding", "llama-index")}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'mlx_providers' has no attribute {name!r}")
    module_name, extra = _HOMES[name]
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{name} needs the '{extra}' extra: "
                          f"pip install 'mlx-providers[{extra}]' ({exc})") from exc
    return getattr(module, name)
