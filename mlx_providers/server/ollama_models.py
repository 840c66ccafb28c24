"""Ollama's model endpoints: ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``,
and ``GET /`` (the liveness text Ollama's tools probe for).

Every model the server was started with is listed under its Ollama name (``name:latest``
for a name without a tag), each registered adapter as ``base:adapter`` (its parent the
base), then the embedding models. ``/api/show`` holds ``model_info`` with
``<arch>.context_length`` (LlamaIndex's Ollama client sizes its context window from it),
``details``, the chat template and the server's defaults as ``parameters`` (strings, as
Ollama's are), and the capabilities: ``completion`` and ``tools`` for every chat model,
``thinking`` when its tokenizer marks reasoning, ``vision`` when it reads images,
``insert`` when its tokenizer has fill-in-the-middle tokens; ``embedding`` for an
embedding model. Nothing here names a path on the server. Facts come from the model's
files (``ollama_model_facts``), read on a worker thread.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from engine import DeclaredModel, Engine, declared_model
from mlx_providers.server.context import ServerContext, read_json
from mlx_providers.server.errors import APIError
from mlx_providers.server.fim import fim_tokens
from mlx_providers.server.ollama_errors import ollama_route
from mlx_providers.server.ollama_model_facts import ModelFacts, model_facts
from mlx_providers.server.ollama_request import tagged, untagged
from mlx_providers.server.served import ServedEmbedding, ServedModel

# The Ollama release whose API this door follows (logprobs included); clients that gate
# a feature on the version read it.
OLLAMA_VERSION = "0.13.0"


@dataclass(frozen=True)
class Listed:
    """One model as the listings show it."""

    name: str  # its Ollama name (tagged)
    facts: ModelFacts
    chat: ServedModel | None = None  # the chat model it runs on (an adapter: the base's)
    embedding: ServedEmbedding | None = None
    parent: str = ""  # an adapter's base

    @property
    def engine(self) -> Engine:
        """The engine that runs it (an embedding model runs on the chat model's)."""
        runs = self.chat or self.embedding
        assert runs is not None, "a listed model is a chat or an embedding model"
        return runs.engine

    def entry(self) -> dict[str, Any]:
        """Its ``/api/tags`` entry."""
        return {"name": self.name, "model": self.name, "modified_at": self.facts.modified_at,
                "size": self.facts.size, "digest": self.facts.digest,
                "details": self.facts.details(self.parent)}


def listed(ctx: ServerContext) -> list[Listed]:
    """Every model the server serves, in ``/v1/models``' order (blocking: reads files)."""
    out: list[Listed] = []
    for one in ctx.models:
        facts = model_facts(one.engine.model_path)
        out.append(Listed(tagged(one.name), facts, chat=one))
        out += [Listed(tagged(f"{one.name}:{adapter}"), facts, chat=one,
                       parent=tagged(one.name)) for adapter in ctx.settings.adapters]
    for name, served in ctx.embeddings.items():
        path = served.engine.embedding_model_path(served.model)
        out.append(Listed(tagged(name), model_facts(path), embedding=served))
    return out


@ollama_route()
async def tags(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    models = await anyio.to_thread.run_sync(listed, ctx)
    return JSONResponse({"models": [m.entry() for m in models]})


@ollama_route()
async def show(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await read_json(request, ctx.settings.max_body_bytes)
    name = body.get("model") or body.get("name")  # "name": older clients' spelling
    if not isinstance(name, str) or not name:
        raise APIError(400, "model: give the model's name", param="model")
    found = await anyio.to_thread.run_sync(_shown, ctx, name)
    return JSONResponse(found)


def _shown(ctx: ServerContext, name: str) -> dict[str, Any]:
    """``/api/show``'s object for the model ``name`` names (404 if none)."""
    models = listed(ctx)
    match = next((m for m in models if m.name == tagged(name)), None)
    base = untagged(name, ctx.models.serves)
    if match is None and ctx.models.serves(base):  # a name it is served under besides
        served = ctx.models.get(base)
        match = next((m for m in models if m.chat is served and not m.parent), None)
    if match is None:
        raise APIError(404, f"model {name!r} not found; this server serves "
                       f"{[m.name for m in models]}", param="model", code="model_not_found")
    facts = match.facts
    arch = facts.family or "model"
    if match.chat is not None:
        engine = match.chat.engine
        context = engine.context_limit or facts.context_length
        declared = _declared(str(engine.model_path))
        capabilities = ["completion", "tools",
                        *(["thinking"] if declared.reasoning else []),
                        *(["vision"] if declared.image_inputs else []),
                        *(["insert"] if _inserts(engine) else [])]
        parameters = (f"temperature {ctx.settings.default_temperature}\n"
                      f"num_predict {ctx.settings.default_max_tokens}\n"
                      + (f"num_ctx {context}\n" if context else ""))
        template = facts.template
    else:
        context, capabilities, parameters, template = facts.context_length, ["embedding"], "", ""
    info: dict[str, Any] = {"general.architecture": arch}
    if facts.parameter_count:
        info["general.parameter_count"] = facts.parameter_count
    if context:
        info[f"{arch}.context_length"] = context
    if facts.embedding_length:
        info[f"{arch}.embedding_length"] = facts.embedding_length
    return {"license": "", "modelfile": f"# served by mlx-providers\nFROM {match.name}\n",
            "parameters": parameters, "template": template,
            "details": facts.details(match.parent), "model_info": info,
            "capabilities": capabilities, "modified_at": facts.modified_at}


_INSERTS: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def _inserts(engine: Engine) -> bool:
    """Whether the engine's tokenizer has fill-in-the-middle tokens (read once; the first
    read may load the model, so off the event loop)."""
    if engine not in _INSERTS:
        _INSERTS[engine] = fim_tokens(engine.tokenizer.get_vocab()) is not None
    return _INSERTS[engine]


@functools.lru_cache(maxsize=64)
def _declared(path: str) -> DeclaredModel:
    return declared_model(path)


@ollama_route()
async def running(request: Request) -> Response:
    """``/api/ps``: the chat models loaded now (keep_alive may have let one go), and the
    embedding models (they stay loaded). MLX on Apple silicon holds weights in memory the
    GPU shares: ``size_vram`` is their size there, 0 on the CPU backend. No
    ``expires_at``: the engine's idle deadline follows the latest request's keep_alive."""
    ctx: ServerContext = request.app.state.ctx
    models = await anyio.to_thread.run_sync(listed, ctx)
    out = []
    for model in models:
        engine = model.engine
        stats = engine.stats()
        if model.chat is not None and not stats.loaded:
            continue
        on_gpu = stats.cpu_kernels == ""  # "" off the CPU (EngineStats.cpu_kernels)
        context = (engine.context_limit if model.chat is not None
                   else model.facts.context_length)
        out.append({**model.entry(), "size_vram": model.facts.size if on_gpu else 0,
                    "context_length": context})
    return JSONResponse({"models": out})


@ollama_route()
async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def root(request: Request) -> Response:
    """What Ollama answers at ``/``: tools probe it to find a server."""
    return PlainTextResponse("Ollama is running")
