"""An OpenAI-compatible HTTP server on the shared engine (needs the ``server`` extra).

``create_app(engine)`` returns a Starlette app serving ``/v1/chat/completions``,
``/v1/responses`` (with a store for ``previous_response_id``), ``/v1/models``,
``/health`` and ``/metrics``; ``mlx-providers serve --model M`` runs it with uvicorn.
It imports the engine's public API only, never LangChain or LlamaIndex.
"""

from __future__ import annotations

from mlx_providers.server.app import create_app
from mlx_providers.server.context import ServerSettings
from mlx_providers.server.responses_store import ResponseStore

__all__ = ["ResponseStore", "ServerSettings", "create_app"]
