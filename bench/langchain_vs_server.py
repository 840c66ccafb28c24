"""Concurrent LangChain streams: ChatMLXBatch in-process vs ChatOpenAI on ``mlx_lm.server``.

The common alternative to an in-process batching model is mlx-lm's own OpenAI-compatible
server, which also batches concurrent requests (``--decode-concurrency``), driven from
LangChain with ``ChatOpenAI(base_url=...)``. This bench runs both on the same model
directory, the same prompts (``"Write two sentences about the number {i}."``) and the same
greedy settings (temperature 0, ``max_tokens`` N), in the same run, one side at a time:

1. ``mlx_lm.server``, started by the bench as a subprocess on 127.0.0.1 (a free port), with
   ``--decode-concurrency`` >= the stream count and ``--prompt-concurrency`` equal to the
   engine's prefill batch, twice:

   a. "project BLAS": started through ``python -c "import engine; ... mlx_lm.server.main()"``
      so that importing ``engine`` loads the fast BLAS before mlx, as in this process;
   b. "as installed": plain ``python -m mlx_lm server`` with ``MLX_PROVIDERS_FAST_BLAS=0``,
      i.e. the reference BLAS the Linux mlx wheel links against (several times slower:
      skip it with ``--skip-installed``).

   Each server is polled on ``GET /v1/models`` until it answers, warmed up with one short
   request, measured, then stopped (terminate, then kill on timeout), even on errors.
2. ``ChatMLXBatch`` in this process, on the same model directory, after a warm-up call.

Each side fans out ``--streams`` concurrent ``astream`` calls with ``asyncio.gather``. Per
stream: time to first content token (TTFT, measured from the start of the fan-out, so it
includes queueing behind the other prompts' prefill) and generated tokens (usage
``output_tokens`` where reported, else content chunks). Aggregate rate = generated tokens /
wall time of the whole fan-out, prefill and HTTP included, as a user of the chains sees it.
Ratios are ChatMLXBatch / server: above 1 for throughput and below 1 for TTFT favour
ChatMLXBatch.

    python bench/langchain_vs_server.py [--model DIR_OR_GGUF] [--streams 16] [--tokens 64]
                                        [--skip-installed]

Needs ``langchain-openai`` (in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from langchain_core.language_models.chat_models import BaseChatModel

import engine  # noqa: F401 - loads the fast BLAS before mlx (the in-process side)
from engine import EngineConfig, blas_info
from mlx_providers import ChatMLXBatch

FAST_BLAS_ENV_VAR = "MLX_PROVIDERS_FAST_BLAS"  # "0" keeps the reference BLAS

HOST = "127.0.0.1"
PROMPT = "Write two sentences about the number {i}."
WARMUP_PROMPT = "Hello"
STARTUP_TIMEOUT_S = 180.0  # until the server answers GET /v1/models
REQUEST_TIMEOUT_S = 1800.0  # per HTTP request; the reference-BLAS server is slow
STOP_TIMEOUT_S = 15.0  # after SIGTERM, before SIGKILL
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Stream:
    """What one concurrent stream produced."""

    ttft: float | None  # seconds from the start of the fan-out to the first content
    tokens: int
    text: str


@dataclass(frozen=True)
class Side:
    """One side of the comparison: every stream of one fan-out."""

    name: str
    streams: list[Stream]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_ttft(self) -> float:
        ttfts = [s.ttft for s in self.streams if s.ttft is not None]
        return sum(ttfts) / len(ttfts) if ttfts else float("nan")


class ServerError(RuntimeError):
    """mlx_lm.server did not start or did not answer; the message has its log's tail."""


def _content_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        part if isinstance(part, str) else str(part.get("text", ""))
        for part in content
        if isinstance(part, str) or part.get("type") == "text"
    )


async def fan_out(name: str, chat: BaseChatModel, prompts: list[str]) -> Side:
    """Every prompt at once through ``chat.astream``; per-stream TTFT and token counts."""
    start = time.perf_counter()

    async def one(prompt: str) -> Stream:
        first: float | None = None
        chunks = 0
        usage_tokens = 0
        parts: list[str] = []
        async for chunk in chat.astream(prompt):
            text = _content_text(chunk.content)
            if text:
                if first is None:
                    first = time.perf_counter() - start
                chunks += 1
                parts.append(text)
            usage = getattr(chunk, "usage_metadata", None)
            if usage:
                usage_tokens += usage.get("output_tokens", 0)
        return Stream(first, usage_tokens or chunks, "".join(parts))

    streams = await asyncio.gather(*(one(p) for p in prompts))
    return Side(name, list(streams), time.perf_counter() - start)


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Server:
    """A running mlx_lm.server subprocess."""

    base_url: str  # ends in /v1
    process: subprocess.Popen[bytes]
    log: IO[bytes]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _log_text(log: IO[bytes]) -> str:
    # pread: the server shares this file's offset, so it must not be moved under it.
    size = os.fstat(log.fileno()).st_size
    return os.pread(log.fileno(), size, 0).decode("utf-8", "replace")


def _log_tail(log: IO[bytes]) -> str:
    return _log_text(log)[-LOG_TAIL_CHARS:]


def _server_command(server_args: list[str], project_blas: bool) -> list[str]:
    if not project_blas:
        return [sys.executable, "-m", "mlx_lm", "server", *server_args]
    code = (
        "import sys, engine\n"
        "from mlx_lm.server import main\n"
        "print('BLAS:', engine.blas_info().name, file=sys.stderr, flush=True)\n"
        f"sys.argv = ['mlx_lm.server', *{server_args!r}]\n"
        "main()\n"
    )
    return [sys.executable, "-c", code]


def _wait_until_ready(server: Server, timeout: float) -> None:
    """Poll GET /v1/models until it answers 200; raise ServerError if the process dies."""
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while True:
        code = server.process.poll()
        if code is not None:
            raise ServerError(
                f"mlx_lm.server exited with code {code} before answering; its log ends:\n"
                + _log_tail(server.log)
            )
        try:
            with no_proxy.open(f"{server.base_url}/models", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ServerError(
                f"mlx_lm.server did not answer GET {server.base_url}/models within "
                f"{timeout:.0f} s; its log ends:\n" + _log_tail(server.log)
            )
        time.sleep(0.25)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def mlx_lm_server(model_path: str, *, project_blas: bool, decode_concurrency: int,
                  prompt_concurrency: int, max_tokens: int) -> Iterator[Server]:
    """Start mlx_lm.server on a free loopback port; always stopped on exit."""
    port = _free_port()
    server_args = [
        "--model", model_path, "--host", HOST, "--port", str(port),
        "--decode-concurrency", str(decode_concurrency),
        "--prompt-concurrency", str(prompt_concurrency),
        "--max-tokens", str(max_tokens), "--temp", "0.0",
    ]
    env = dict(os.environ)
    if not project_blas:
        env[FAST_BLAS_ENV_VAR] = "0"  # mlx_lm never imports engine; this is belt and braces
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            _server_command(server_args, project_blas), env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            server = Server(f"http://{HOST}:{port}/v1", process, log)
            _wait_until_ready(server, STARTUP_TIMEOUT_S)
            yield server
        finally:
            _stop(process)


def _server_blas(server: Server, project_blas: bool) -> str:
    if not project_blas:
        return f"reference ({FAST_BLAS_ENV_VAR}=0, as the mlx wheel links it)"
    for line in _log_text(server.log).splitlines():
        if line.startswith("BLAS: "):
            return line.removeprefix("BLAS: ")
    return "unknown"


async def run_server_side(name: str, model_path: str, prompts: list[str], tokens: int, *,
                          project_blas: bool, decode_concurrency: int,
                          prompt_concurrency: int) -> tuple[Side, str]:
    """Start the server, warm it up, fan out the ChatOpenAI streams, stop the server."""
    try:
        import httpx
        from langchain_openai import ChatOpenAI
        from pydantic import SecretStr
    except ImportError as exc:  # pragma: no cover - a missing optional dependency
        raise SystemExit(
            "this bench needs langchain-openai: pip install 'langchain-openai>=1.0'"
        ) from exc

    with mlx_lm_server(model_path, project_blas=project_blas,
                       decode_concurrency=decode_concurrency,
                       prompt_concurrency=prompt_concurrency, max_tokens=tokens) as server:
        blas = _server_blas(server, project_blas)
        # trust_env=False: loopback traffic must not go through an HTTP(S)_PROXY.
        async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:

            def chat(max_tokens: int) -> ChatOpenAI:
                return ChatOpenAI(
                    # max_completion_tokens is ChatOpenAI's typed alias of max_tokens.
                    base_url=server.base_url, api_key=SecretStr("none"), model=model_path,
                    temperature=0, max_completion_tokens=max_tokens, streaming=True,
                    stream_usage=True, max_retries=0, timeout=REQUEST_TIMEOUT_S,
                    http_async_client=client,
                )

            try:
                await chat(4).ainvoke(WARMUP_PROMPT)  # loads the model, compiles kernels
            except Exception as exc:
                raise ServerError(
                    f"warm-up request to mlx_lm.server failed ({exc!r}); its log ends:\n"
                    + _log_tail(server.log)
                ) from exc
            try:
                side = await fan_out(name, chat(tokens), prompts)
            except Exception as exc:
                raise ServerError(
                    f"the streams to mlx_lm.server failed ({exc!r}); its log ends:\n"
                    + _log_tail(server.log)
                ) from exc
    return side, blas


async def run_in_process(model: str | None, prompts: list[str], tokens: int,
                         engine_config: dict[str, Any]) -> Side:
    """The same fan-out through ChatMLXBatch on the shared in-process engine."""
    warm = ChatMLXBatch(model=model, max_tokens=4, temperature=0, engine_config=engine_config)
    await warm.ainvoke(WARMUP_PROMPT)  # loads the model, compiles kernels
    chat = ChatMLXBatch(model=model, max_tokens=tokens, temperature=0,
                        engine_config=engine_config)
    return await fan_out("ChatMLXBatch (in-process)", chat, prompts)


# --------------------------------------------------------------------------- report


def print_table(sides: list[Side]) -> None:
    print("| side | streams | tokens | wall s | agg tok/s | mean TTFT s |")
    print("|------|--------:|-------:|-------:|----------:|------------:|")
    for side in sides:
        print(f"| {side.name} | {len(side.streams)} | {side.tokens} | {side.seconds:.2f} | "
              f"{side.rate:.1f} | {side.mean_ttft:.3f} |")


def print_ratios(ours: Side, server: Side, label: str) -> None:
    same = sum(a.text == b.text for a, b in zip(ours.streams, server.streams))
    print(f"ChatMLXBatch / server ({label}): throughput {ours.rate / server.rate:.2f}x, "
          f"mean TTFT {ours.mean_ttft / server.mean_ttft:.2f}x "
          f"(identical answers: {same}/{len(ours.streams)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="model dir or .gguf (default: SmolLM2, as ChatMLXBatch loads it)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-installed", action="store_true",
                        help="skip the (slow) server run on the reference BLAS")
    args = parser.parse_args()
    if args.streams < 1 or args.tokens < 1:
        parser.error("--streams and --tokens must be >= 1")

    prompts = [PROMPT.format(i=i) for i in range(args.streams)]
    defaults = EngineConfig()
    # Same batch shape on both sides: every stream decodes together, prompts prefill in
    # groups of the engine's default prefill batch (mlx_lm.server's default is also 8).
    decode = max(args.streams, defaults.max_batch)
    engine_config = {"max_batch": decode, "prefill_batch": defaults.prefill_batch}
    # Resolving the path converts a .gguf if needed; it does not load the weights.
    model_path = str(Path(ChatMLXBatch(model=args.model, engine_config=engine_config)
                          .engine.model_path).resolve())
    print(f"model: {model_path}")
    print(f"streams: {args.streams}, max_tokens: {args.tokens}, temperature 0, "
          f"decode concurrency {decode}, prompt concurrency {defaults.prefill_batch}")

    server_runs = [("mlx_lm.server (project BLAS)", True)]
    if not args.skip_installed:
        server_runs.append(("mlx_lm.server (as installed)", False))
    servers: list[Side] = []
    for name, project_blas in server_runs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        side, blas = asyncio.run(run_server_side(
            name, model_path, prompts, args.tokens, project_blas=project_blas,
            decode_concurrency=decode, prompt_concurrency=defaults.prefill_batch))
        print(f"{name} BLAS: {blas}")
        servers.append(side)

    print("running ChatMLXBatch (in-process) ...", file=sys.stderr, flush=True)
    shared = ChatMLXBatch(model=args.model, engine_config=engine_config).engine
    try:
        ours = asyncio.run(run_in_process(args.model, prompts, args.tokens, engine_config))
        print(f"ChatMLXBatch BLAS: {blas_info().name}")
        print(f"ChatMLXBatch peak rows decoding together: {shared.stats().peak_running}\n")
    finally:
        shared.close()

    print_table([*servers, ours])
    print()
    labels = ["project BLAS", "as installed"]
    for server, label in zip(servers, labels):
        print_ratios(ours, server, label)
    print("(throughput > 1x and TTFT < 1x favour ChatMLXBatch)")


if __name__ == "__main__":
    main()
