"""16 concurrent streams through the server's four doors, on one batch.

The doors: OpenAI chat completions (``/v1/chat/completions``), Anthropic's Messages
(``/v1/messages``), Ollama's chat (``/api/chat``, NDJSON) and the legacy completions
(``/v1/completions``). One server on loopback (``python -m mlx_providers.server``) on the
default model, greedy, the same prompts everywhere; each stream is plain HTTP (httpx), so
no client library's own overhead is in the figures. Cases, in one run:

- each door alone: ``--streams`` concurrent streams through it, ``--rounds`` times in turn
  with the others; aggregate tok/s (the tokens its usage reports / the fan-out's wall time),
  a stream's own decode rate (tokens after its first / the time they took: independent of
  how long an answer is) and mean TTFT (first text, from the start of the fan-out), as
  ratios to the chat-completions door. The completions door is sent the chat turn written
  out in ChatML (the default model's template), so its answers are as long as the others';
- mixed: the same number of streams split evenly over the four doors at once; per door
  tok/s and TTFT, and the most rows the engine ran at once while they did (``/metrics``'
  ``mlx_engine_running_rows``, polled): all of them in one batch reads ``--streams``.

Goal (issue 49): every door >= 0.95 of the chat door's tok/s at 16 streams; mixed-door
streams share one batch (peak rows 16). The machine's other load makes these noisy: read
ratios from one run.

    python bench/doors.py [--model DIR_OR_GGUF] [--streams 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

import engine  # noqa: F401 - the fast BLAS before mlx (the server is its own process)
from engine import blas_info
from engine.models.default_model import default_model_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from langchain_vs_server import PROMPT
from server_vs_mlx_lm import our_server

TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Run:
    """One stream: seconds to its first and last text (from the fan-out's start), tokens
    generated."""

    ttft: float | None
    tokens: int
    last: float | None = None

    @property
    def rate(self) -> float | None:
        """Its own decode rate: tokens after the first over the time they took."""
        if self.ttft is None or self.last is None or self.last <= self.ttft or self.tokens < 2:
            return None
        return (self.tokens - 1) / (self.last - self.ttft)


class Clock:
    """When a stream's first and last text came."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last: float | None = None

    def text(self) -> None:
        now = time.perf_counter() - self.start
        self.first = now if self.first is None else self.first
        self.last = now

    def run(self, tokens: int) -> Run:
        return Run(self.first, tokens, self.last)


async def _lines(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.strip():
            yield line


async def _sse(response: httpx.Response) -> AsyncIterator[dict]:
    async for line in _lines(response):
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


async def chat(http: httpx.AsyncClient, base: str, model: str, prompt: str, tokens: int,
               start: float) -> Run:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}
    clock, used = Clock(start), 0
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for event in _sse(response):
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                clock.text()
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
    return clock.run(used)


async def messages(http: httpx.AsyncClient, base: str, model: str, prompt: str, tokens: int,
                   start: float) -> Run:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": prompt}]}
    clock, used = Clock(start), 0
    async with http.stream("POST", f"{base}/v1/messages", json=body,
                           headers={"anthropic-version": "2023-06-01"}) as response:
        response.raise_for_status()
        async for event in _sse(response):
            kind = event.get("type")
            if kind == "content_block_delta" and event.get("delta", {}).get("text"):
                clock.text()
            if kind == "message_delta":
                used = event.get("usage", {}).get("output_tokens", used)
    return clock.run(used)


async def ollama(http: httpx.AsyncClient, base: str, model: str, prompt: str, tokens: int,
                 start: float) -> Run:
    body = {"model": model, "stream": True,
            "options": {"temperature": 0, "num_predict": tokens},
            "messages": [{"role": "user", "content": prompt}]}
    clock, used = Clock(start), 0
    async with http.stream("POST", f"{base}/api/chat", json=body) as response:
        response.raise_for_status()
        async for line in _lines(response):
            event = json.loads(line)
            if event.get("message", {}).get("content"):
                clock.text()
            if event.get("done"):
                used = event.get("eval_count", 0)
    return clock.run(used)


async def completions(http: httpx.AsyncClient, base: str, model: str, prompt: str,
                      tokens: int, start: float) -> Run:
    # The chat turn written out (ChatML, the default model's template): the raw prompt then
    # asks for an answer as long as the chat doors', not a continuation that may end at once.
    raw = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt": raw}
    clock, used = Clock(start), 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for event in _sse(response):
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                clock.text()
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
    return clock.run(used)


Door = Callable[[httpx.AsyncClient, str, str, str, int, float], Awaitable[Run]]
DOORS: dict[str, Door] = {"chat completions": chat, "messages": messages,
                          "ollama chat": ollama, "completions": completions}


async def _peak_rows(http: httpx.AsyncClient, base: str, stop: asyncio.Event) -> int:
    """The most rows the engine held at once while ``stop`` is unset (polled /metrics)."""
    peak = 0
    while not stop.is_set():
        text = (await http.get(f"{base}/metrics")).text
        for line in text.splitlines():
            if line.startswith("mlx_engine_running_rows"):
                peak = max(peak, int(float(line.rsplit(" ", 1)[1])))
        await asyncio.sleep(0.05)
    return peak


async def fan_out(base: str, model: str, doors: list[str], tokens: int,
                  ) -> tuple[dict[str, list[Run]], float, int]:
    """Stream ``i`` through ``doors[i]``, all at once: runs by door, wall seconds, peak rows."""
    limits = httpx.Limits(max_connections=len(doors) + 8)
    async with httpx.AsyncClient(trust_env=False, timeout=TIMEOUT_S, limits=limits) as http:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_peak_rows(http, base, stop))
        start = time.perf_counter()
        runs = await asyncio.gather(*(DOORS[door](http, base, model, PROMPT.format(i=i),
                                                  tokens, start)
                                      for i, door in enumerate(doors)))
        wall = time.perf_counter() - start
        stop.set()
        peak = await watcher
    by_door: dict[str, list[Run]] = {}
    for door, run in zip(doors, runs):
        by_door.setdefault(door, []).append(run)
    return by_door, wall, peak


def _rate(runs: list[Run], wall: float) -> float:
    return sum(run.tokens for run in runs) / wall


def _stream_rate(runs: list[Run]) -> float:
    rates = [run.rate for run in runs if run.rate is not None]
    return statistics.mean(rates) if rates else float("nan")


def _ttft(runs: list[Run]) -> float:
    firsts = [run.ttft for run in runs if run.ttft is not None]
    return statistics.mean(firsts) if firsts else float("nan")


async def main_async(args: argparse.Namespace) -> None:
    model = args.model or str(default_model_gguf())
    with our_server(model, max_batch=args.streams, prefill_batch=8,
                    max_tokens=args.tokens) as v1:
        base = v1.removesuffix("/v1")
        await fan_out(base, model, list(DOORS), 4)  # warm every door's path once
        await fan_out(base, model, ["chat completions"] * args.streams, args.tokens)
        print(f"\n{args.streams} streams through one door at a time, {args.tokens} tokens, "
              f"greedy; each door {args.rounds} times, in turn (means):\n")
        print("| door | tokens | tok/s | vs chat | tok/s a stream | vs chat | mean TTFT s | "
              "vs chat | peak rows |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        alone: dict[str, list[tuple[int, float, float, float, int]]] = {d: [] for d in DOORS}
        for _ in range(args.rounds):
            for door in DOORS:
                runs, wall, peak = await fan_out(base, model, [door] * args.streams,
                                                 args.tokens)
                mine = runs[door]
                alone[door].append((sum(r.tokens for r in mine), _rate(mine, wall),
                                    _stream_rate(mine), _ttft(mine), peak))
        means = {door: [statistics.mean(column) for column in zip(*rows)]
                 for door, rows in alone.items()}
        chat_figures = means["chat completions"]
        for door, (tokens, rate, stream, ttft, peak) in means.items():
            print(f"| {door} | {tokens:.0f} | {rate:.1f} | {rate / chat_figures[1]:.2f} | "
                  f"{stream:.1f} | {stream / chat_figures[2]:.2f} | {ttft:.2f} | "
                  f"{ttft / chat_figures[3]:.2f} | {peak:.0f} |")
        doors = [list(DOORS)[i % len(DOORS)] for i in range(args.streams)]
        runs, wall, peak = await fan_out(base, model, doors, args.tokens)
        total = sum(run.tokens for door_runs in runs.values() for run in door_runs)
        print(f"\nmixed: {args.streams} streams over the four doors at once: "
              f"{total / wall:.1f} tok/s in all, peak rows {peak}\n")
        print("| door | streams | tokens | tok/s a stream | mean TTFT s |")
        print("|---|---:|---:|---:|---:|")
        for door, door_runs in runs.items():
            print(f"| {door} | {len(door_runs)} | {sum(r.tokens for r in door_runs)} | "
                  f"{_stream_rate(door_runs):.1f} | {_ttft(door_runs):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"BLAS: {blas_info().name}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
