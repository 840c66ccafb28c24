"""What the engine's host work costs where the forward is cheap, as on the GPUs users run.

The model is the default model's vocabulary (SmolLM2, 49,152 tokens) on a llama of 2
layers, hidden 128, random weights (``testkit.host_regime_model``): a step costs about
MLX's CPU dispatch floor, so what the engine does on the host between forwards shows.
In one run, per row count, interleaved and best of ``--repeats``:

- **raw**: mlx-lm's ``BatchGenerator`` driven directly on the same weights, greedy;
- **engine 0%**: the same prompts through ``Engine``, no constraint;
- **engine 50% / 100%**: half / all rows constrained, rotating a JSON schema, a forced
  tool call and the tools-or-answer union (each made so it cannot complete within the
  token budget, so every row decodes the whole window).

Decode rate = generated tokens / (last token time - first token time). Host work exposed
a step = the engine's step time minus the raw generator's (time per step = rows / rate).
Syncs a step = ``mx.eval`` calls per lane step (the raw generator makes one).
``--streams N`` adds N plain rows streamed through ``ChatMLXBatch.astream`` and through the
server (``openai`` SDK, loopback), against ``Engine.submit`` in the same run, each as every
row's tokens over the time from the requests to the last token.

    python bench/host_overhead.py [--rows 1,4,16,32] [--tokens 64] [--repeats 3]
                                  [--blas-threads 1] [--streams 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None,
                        help="model dir (default: the host-regime model, built once)")
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="BLAS threads (1: one core plays the device)")
    parser.add_argument("--speculation", type=int, default=0,
                        help="the engine's speculation (0: off, as the raw generator has none)")
    parser.add_argument("--streams", type=int, default=0,
                        help="also stream this many rows through ChatMLXBatch and the server")
    return parser.parse_args()


ARGS = _arguments()
if ARGS.blas_threads is not None:  # read when the BLAS loads, below
    os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.blas_threads)
    os.environ["OMP_NUM_THREADS"] = str(ARGS.blas_threads)

import importlib  # noqa: E402
import itertools  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import engine  # noqa: E402, F401 - loads the fast BLAS before mlx
from engine import ChatRequest, Engine, SamplingParams, blas_info, get_engine  # noqa: E402
from engine.requests.inbound.output_constraint import JsonSchema  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.engine_throughput import raw_batch_generator  # noqa: E402

mx = importlib.import_module("mlx.core")  # after engine: the fast BLAS loads first

# Cannot complete within the token budget: a constrained row decodes the whole window.
LONG_LIST: dict[str, Any] = {"type": "array", "minItems": 200,
                             "items": {"type": "string", "maxLength": 24}}
RECORD_TOOL = {"type": "function", "function": {
    "name": "record", "description": "Record the items.",
    "parameters": {"type": "object", "properties": {"items": LONG_LIST},
                   "required": ["items"]}}}
KINDS = ("schema", "forced call", "union")
_runs = itertools.count()


class SyncCounter:
    """Counts ``mx.eval`` calls (the host waiting on the device) while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._eval: Callable[..., Any] = mx.eval

    def __enter__(self) -> SyncCounter:
        original = self._eval

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        mx.eval = counted
        return self

    def __exit__(self, *_: object) -> None:
        mx.eval = self._eval


def messages(i: int, run: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"List fruits, please ({run}.{i})."}]


def request(i: int, run: int, constrained: bool, tokens: int) -> ChatRequest:
    kind = KINDS[i % len(KINDS)] if constrained else None
    params = SamplingParams(max_tokens=tokens, ignore_eos=True,
                            constraint=JsonSchema(LONG_LIST) if kind in ("schema", "union")
                            else None)
    if kind == "forced call":
        return ChatRequest.from_openai(messages(i, run), params, tools=[RECORD_TOOL],
                                       tool_choice="required")
    if kind == "union":
        return ChatRequest.from_openai(messages(i, run), params, tools=[RECORD_TOOL])
    return ChatRequest.from_openai(messages(i, run), params)


def through_engine(eng: Engine, rows: int, share: float, tokens: int) -> tuple[float, float]:
    """(decode tok/s, syncs per lane step) with ``share`` of the rows constrained."""
    run = next(_runs)
    constrained = round(rows * share)
    stamps: list[float] = []
    lock = threading.Lock()

    def on_token(_t: int, _d: str) -> None:
        with lock:
            stamps.append(time.perf_counter())

    before = eng.stats()
    with SyncCounter() as syncs:
        handles = [eng.submit(request(i, run, i < constrained, tokens), on_token=on_token)
                   for i in range(rows)]
        for handle in handles:
            handle.result()
    steps = max(1, eng.stats().steps - before.steps)
    return len(stamps) / (max(stamps) - min(stamps)), syncs.count / steps


def raw(eng: Engine, rows: int, tokens: int) -> float:
    run = next(_runs)
    prompts = []
    for i in range(rows):
        text = eng.tokenizer.apply_chat_template(messages(i, run), add_generation_prompt=True,
                                                 tokenize=False)
        prompts.append(list(eng.tokenizer.encode(text, add_special_tokens=False)))
    return raw_batch_generator(eng, prompts, tokens)[0]


def host_regime_path() -> Path:
    from testkit.host_regime_model import host_regime_model

    return host_regime_model()


def exposed_us(rows: int, raw_rate: float, rate: float) -> float:
    """The engine's step time minus the raw generator's, in microseconds."""
    return 1e6 * rows * (1 / rate - 1 / raw_rate)


def engine_table(eng: Engine, levels: list[int], tokens: int, repeats: int) -> None:
    print("| rows | raw tok/s | engine 0% | / raw | host us/step | us/row | syncs/step "
          "| engine 50% | / 0% | engine 100% | / 0% | syncs/step (100%) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in levels:
        best: dict[str, tuple[float, float]] = {}
        for _ in range(repeats):  # interleaved, best of n: less noise on a shared CPU
            runs = {"raw": (raw(eng, rows, tokens), 1.0),
                    "0": through_engine(eng, rows, 0.0, tokens),
                    "50": through_engine(eng, rows, 0.5, tokens),
                    "100": through_engine(eng, rows, 1.0, tokens)}
            for key, value in runs.items():
                if key not in best or value[0] > best[key][0]:
                    best[key] = value
        base, plain = best["raw"][0], best["0"][0]
        exposed = exposed_us(rows, base, plain)
        half = best["50"][0] if rows > 1 else float("nan")
        print(f"| {rows} | {base:.1f} | {plain:.1f} | {plain / base:.3f} | {exposed:.0f} "
              f"| {exposed / rows:.1f} | {best['0'][1]:.2f} | {half:.1f} | {half / plain:.3f} "
              f"| {best['100'][0]:.1f} | {best['100'][0] / plain:.3f} | {best['100'][1]:.2f} |",
              flush=True)


# The stream table's rate: every row's tokens over the wall time from the requests to the
# last event. Doors may merge text into fewer chunks (a server holds back what could open a
# tool call), so chunks are not counted; the model never ends a row early, so each row
# decodes exactly ``tokens``.
async def _astream_wall(model: str, settings: dict[str, int], rows: int, tokens: int) -> float:
    from mlx_providers import ChatMLXBatch

    chat = ChatMLXBatch(model=model, engine_config=settings, temperature=0.0, max_tokens=tokens)
    await chat.ainvoke("warm up")
    run = next(_runs)

    async def one(i: int) -> None:
        async for _ in chat.astream(messages(i, run)):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(rows)))
    return time.perf_counter() - start


async def _server_wall(eng: Engine, rows: int, tokens: int) -> float:
    """``rows`` streams through the server on this engine (uvicorn on loopback in a thread,
    as ``mlx-providers serve`` runs it), driven by the ``openai`` SDK."""
    import socket

    import uvicorn
    from openai import AsyncOpenAI

    from mlx_providers.server.app import create_app, served_name

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(eng), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.02)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    run = next(_runs)
    counted: list[int] = []

    async def one(i: int) -> None:
        stream = await client.chat.completions.create(
            model=served_name(eng), messages=messages(i, run),  # type: ignore[arg-type]
            max_tokens=tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                counted.append(chunk.usage.completion_tokens)

    try:
        await one(-1)  # warm-up
        counted.clear()
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(rows)))
        wall = time.perf_counter() - start
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert counted == [tokens] * rows, counted  # every row decoded the whole window
    return wall


def _submit_wall(eng: Engine, rows: int, tokens: int) -> float:
    run = next(_runs)
    start = time.perf_counter()
    handles = [eng.submit(request(i, run, False, tokens)) for i in range(rows)]
    for handle in handles:
        handle.result()
    return time.perf_counter() - start


def stream_table(model: str, settings: dict[str, int], rows: int, tokens: int,
                 eng: Engine) -> None:
    plain = rows * tokens / _submit_wall(eng, rows, tokens)
    lc = rows * tokens / asyncio.run(_astream_wall(model, settings, rows, tokens))
    http = rows * tokens / asyncio.run(_server_wall(eng, rows, tokens))
    print(f"\n| {rows} plain rows, requests to last token | tok/s | / engine |\n"
          f"|---|---:|---:|\n"
          f"| Engine.submit | {plain:.1f} | 1.000 |\n"
          f"| ChatMLXBatch.astream | {lc:.1f} | {lc / plain:.3f} |\n"
          f"| server, openai SDK streams | {http:.1f} | {http / plain:.3f} |", flush=True)


def main() -> None:
    model = ARGS.model or str(host_regime_path())
    levels = [int(x) for x in ARGS.rows.split(",")]
    width = max([*levels, ARGS.streams])
    # The shared engine ChatMLXBatch with the same settings also gets (--streams).
    settings = dict(max_batch=width, prefill_batch=width, speculation=ARGS.speculation)
    eng = get_engine(model, **settings)
    print(f"model: {eng.model_path}\nBLAS: {blas_info().name} "
          f"(threads: {ARGS.blas_threads or 'default'})\n")
    through_engine(eng, 2, 1.0, 8)  # warm-up, and compiles the grammars once
    engine_table(eng, levels, ARGS.tokens, ARGS.repeats)
    if ARGS.streams:
        stream_table(model, settings, ARGS.streams, ARGS.tokens, eng)
    eng.close()


if __name__ == "__main__":
    try:
        main()
    finally:
        mx.clear_streams()  # the raw generator ran MLX on this thread (see engine_throughput)
