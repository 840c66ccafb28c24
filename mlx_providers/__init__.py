"""LangChain and LlamaIndex integrations on one shared MLX continuous-batching engine.

``ChatMLXBatch`` (LangChain, needs ``langchain-core``) and ``MLXBatchLLM`` (LlamaIndex,
needs ``llama-index-core``) are imported lazily, so either framework alone is enough.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_providers.langchain import ChatMLXBatch
    from mlx_providers.llama_index import MLXBatchLLM

__all__ = ["ChatMLXBatch", "MLXBatchLLM"]

_HOMES = {"ChatMLXBatch": ("mlx_providers.langchain", "langchain"),
          "MLXBatchLLM": ("mlx_providers.llama_index", "llama-index")}


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
