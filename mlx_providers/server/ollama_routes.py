"""Ollama's API door: its routes, mounted beside the OpenAI ones by ``create_app``.

``/api/chat``, ``/api/generate``, ``/api/embed`` generate and embed through the same
engine, admission and cancellation as ``/v1/...``; ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version`` and ``/`` describe the server as Ollama's clients expect.
``mlx-providers serve --ollama-port 11434`` also listens on Ollama's port, so a client
left at its default host finds this server (docs/server.md, "Ollama API").
"""

from __future__ import annotations

from starlette.routing import Route

from mlx_providers.server.ollama_chat import ollama_chat
from mlx_providers.server.ollama_embed import ollama_embed
from mlx_providers.server.ollama_generate import ollama_generate
from mlx_providers.server.ollama_models import root, running, show, tags, version

OLLAMA_ROUTES = [
    Route("/", root, methods=["GET"]),
    Route("/api/chat", ollama_chat, methods=["POST"]),
    Route("/api/generate", ollama_generate, methods=["POST"]),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", running, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
