"""16 concurrent ``openai`` SDK streams: this project's server vs ``mlx_lm.server``.

Both servers are started by the bench on loopback, one at a time, on the same model
directory with the same BLAS (``mlx_lm.server`` is started through ``import engine`` so
the project's fast BLAS is loaded first, as in ``bench/langchain_vs_server.py``, whose
server helpers this reuses), the same prompts and greedy settings. Each side fans out
``--streams`` concurrent ``AsyncOpenAI`` chat-completion streams (``include_usage``):

- aggregate rate = generated tokens (usage) / wall time of the whole fan-out;
- TTFT per stream = first content delta, measured from the start of the fan-out.

Each side also serves five streams one at a time, idle in between: the mean TTFT of a lone
request, which this server's admission window (``--admission-window``) adds to.

Then the same load through ``ChatMLXBatch`` in this process (the server's overhead over
in-process use), and, on this project's server, turn-2 TTFT of a Responses conversation
continued with ``previous_response_id`` vs the same history resent in full vs that
history never seen before (a cold prefix cache).

Goals (issue 12): throughput >= 1.5x and mean TTFT <= 0.5x of mlx_lm.server; throughput
within 10% of in-process ChatMLXBatch. The machine's other load makes all of these noisy:
read ratios from one run together, and rerun before believing a small difference.

    python bench/server_vs_mlx_lm.py [--model DIR_OR_GGUF] [--streams 16] [--tokens 64]
        [--admission-window SECONDS] [--skip-continuation]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

import engine  # noqa: F401 - the fast BLAS before mlx (the in-process side)
from engine import EngineConfig, blas_info
from mlx_providers import ChatMLXBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# A sibling script, not a package: its mlx_lm.server helpers and report are reused.
from langchain_vs_server import (
    HOST,
    PROMPT,
    WARMUP_PROMPT,
    ServerError,
    Side,
    Stream,
    _free_port,
    _log_tail,
    _stop,
    fan_out,
    mlx_lm_server,
    print_table,
)

STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 600.0


@contextlib.contextmanager
def our_server(model_path: str, *, max_batch: int, prefill_batch: int, max_tokens: int,
               admission_window: float | None = None) -> Iterator[str]:
    """``python -m mlx_providers.server`` on a free loopback port; the base URL."""
    port = _free_port()
    command = [sys.executable, "-m", "mlx_providers.server", "--model", model_path,
               "--served-model-name", model_path, "--host", HOST, "--port", str(port),
               "--max-batch", str(max_batch), "--prefill-batch", str(prefill_batch),
               "--max-tokens", str(max_tokens), "--log-level", "warning"]
    if admission_window is not None:
        command += ["--admission-window", str(admission_window)]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if process.poll() is not None:
                    raise ServerError("mlx_providers.server exited; its log ends:\n"
                                      + _log_tail(log))
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://{HOST}:{port}/health", timeout=5,
                                 trust_env=False).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerError("mlx_providers.server did not become healthy; its log "
                                      "ends:\n" + _log_tail(log))
                time.sleep(0.25)
            yield f"http://{HOST}:{port}/v1"
        finally:
            _stop(process)


async def sdk_fan_out(name: str, base_url: str, model: str, prompts: list[str],
                      tokens: int) -> Side:
    """Every prompt at once as an ``AsyncOpenAI`` stream; TTFT and usage per stream."""
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=len(prompts) + 4)
                                 ) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    http_client=http)
        await client.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": WARMUP_PROMPT}])
        start = time.perf_counter()

        async def one(prompt: str) -> Stream:
            first: float | None = None
            parts: list[str] = []
            used = 0
            stream = await client.chat.completions.create(
                model=model, max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": prompt}])
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - start
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            return Stream(first, used or len(parts), "".join(parts))

        streams = await asyncio.gather(*(one(p) for p in prompts))
    return Side(name, list(streams), time.perf_counter() - start)


async def lone_ttft(base_url: str, model: str, rounds: int = 5) -> float:
    """Mean TTFT of one stream at a time on an idle server (new prompts, so no request
    finds its whole prompt cached): what a burst-gathering admission window costs."""
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    http_client=http)
        seconds = []
        for i in range(rounds):
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model, max_tokens=2, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Name a colour ({i})."}])
            first: float | None = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            seconds.append(first if first is not None else time.perf_counter() - start)
    return sum(seconds) / len(seconds)


async def continuation_ttft(base_url: str, model: str, rounds: int = 3) -> dict[str, Any]:
    """Turn-2 TTFT of a Responses conversation: previous_response_id, resent, cold."""
    head = ("You are a careful assistant. Keep answers short. " * 12).strip()
    results: dict[str, list[tuple[float, int]]] = {"previous_response_id": [],
                                                   "history resent": [], "cold history": []}
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    http_client=http)

        async def ttft(**kw: Any) -> tuple[float, int]:
            start = time.perf_counter()
            first = None
            cached = 0
            stream = await client.responses.create(model=model, max_output_tokens=8,
                                                   stream=True, **kw)
            async for event in stream:
                if event.type == "response.output_text.delta" and first is None:
                    first = time.perf_counter() - start
                if event.type in ("response.completed", "response.incomplete"):
                    usage = event.response.usage
                    cached = usage.input_tokens_details.cached_tokens if usage else 0
            return (first if first is not None else float("nan")), cached

        for i in range(rounds):
            for mode in results:
                # Unique from the first token: only this conversation's own turn 1 can hit.
                question = f"Conversation {i} ({mode}). {head} Tell me about the number {i}."
                if mode == "cold history":  # a turn 1 this server never generated
                    answer = f"The number {i} is a number."
                else:
                    r1 = await client.responses.create(model=model, input=question,
                                                       max_output_tokens=48)
                    answer = r1.output_text
                follow = "And twice that number?"
                if mode == "previous_response_id":
                    results[mode].append(await ttft(input=follow, previous_response_id=r1.id))
                else:
                    results[mode].append(await ttft(input=[
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": follow}]))
    return {mode: (sum(t for t, _ in xs) / len(xs), sum(c for _, c in xs) / len(xs))
            for mode, xs in results.items()}


async def in_process(model: str, prompts: list[str], tokens: int,
                     engine_config: dict[str, Any]) -> Side:
    warm = ChatMLXBatch(model=model, max_tokens=4, temperature=0, engine_config=engine_config)
    await warm.ainvoke(WARMUP_PROMPT)
    chat = ChatMLXBatch(model=model, max_tokens=tokens, temperature=0, streaming=True,
                        engine_config=engine_config)
    return await fan_out("ChatMLXBatch (in-process)", chat, prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default SmolLM2)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-continuation", action="store_true")
    parser.add_argument("--admission-window", type=float, default=None,
                        help="this server's --admission-window (default: the server's)")
    args = parser.parse_args()
    prompts = [PROMPT.format(i=i) for i in range(args.streams)]
    defaults = EngineConfig()
    decode = max(args.streams, defaults.max_batch)
    engine_config = {"max_batch": decode, "prefill_batch": defaults.prefill_batch}
    resolver = ChatMLXBatch(model=args.model, engine_config=engine_config).engine
    model_path = str(Path(resolver.model_path).resolve())
    print(f"model: {model_path}")
    print(f"streams: {args.streams}, max_tokens: {args.tokens}, temperature 0, decode "
          f"concurrency {decode}, prompt concurrency {defaults.prefill_batch}, "
          f"BLAS {blas_info().name}, load average {os.getloadavg()[0]:.2f}")

    print("running mlx_lm.server (project BLAS) ...", file=sys.stderr, flush=True)
    with mlx_lm_server(model_path, project_blas=True, decode_concurrency=decode,
                       prompt_concurrency=defaults.prefill_batch,
                       max_tokens=args.tokens) as server:
        theirs = asyncio.run(sdk_fan_out("mlx_lm.server (project BLAS)", server.base_url,
                                         model_path, prompts, args.tokens))
        theirs_lone = asyncio.run(lone_ttft(server.base_url, model_path))

    print("running mlx_providers.server ...", file=sys.stderr, flush=True)
    continuation: dict[str, Any] = {}
    with our_server(model_path, max_batch=decode, prefill_batch=defaults.prefill_batch,
                    max_tokens=args.tokens, admission_window=args.admission_window
                    ) as base_url:
        ours = asyncio.run(sdk_fan_out("mlx_providers.server", base_url, model_path,
                                       prompts, args.tokens))
        ours_lone = asyncio.run(lone_ttft(base_url, model_path))
        if not args.skip_continuation:
            continuation = asyncio.run(continuation_ttft(base_url, model_path))

    print("running ChatMLXBatch (in-process) ...", file=sys.stderr, flush=True)
    try:
        local = asyncio.run(in_process(args.model, prompts, args.tokens, engine_config))
    finally:
        resolver.close()

    print()
    print_table([theirs, ours, local])
    print()
    same = sum(a.text == b.text for a, b in zip(ours.streams, theirs.streams))
    print(f"server / mlx_lm.server: throughput {ours.rate / theirs.rate:.2f}x (goal >= 1.5x), "
          f"mean TTFT {ours.mean_ttft / theirs.mean_ttft:.2f}x (goal <= 0.5x); "
          f"identical answers {same}/{len(ours.streams)}")
    window = "server default" if args.admission_window is None else args.admission_window
    print(f"one stream at a time (admission window: {window}): mean TTFT "
          f"{ours_lone:.3f} s vs mlx_lm.server {theirs_lone:.3f} s "
          f"({ours_lone / theirs_lone:.2f}x)")
    print(f"server / in-process ChatMLXBatch: throughput {ours.rate / local.rate:.2f}x "
          f"(goal >= 0.90x), mean TTFT {ours.mean_ttft / local.mean_ttft:.2f}x")
    if continuation:
        print("\n| turn 2 (Responses) | mean TTFT s | mean cached tokens |")
        print("|---|---:|---:|")
        for mode, (seconds, cached) in continuation.items():
            print(f"| {mode} | {seconds:.3f} | {cached:.0f} |")


if __name__ == "__main__":
    main()
