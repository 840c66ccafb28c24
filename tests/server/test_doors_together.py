"""The four doors on one batch: streams through chat completions, Anthropic's Messages,
Ollama's chat and the legacy completions, sent together, decode as rows of one batch, and
each gives the text it gives alone (a row's tokens never depend on its neighbours)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from engine import Engine
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(180)
TOKENS = 24


async def _chat(http: httpx.AsyncClient, url: str) -> str:
    body = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    return "".join([event["choices"][0]["delta"].get("content") or ""
                    async for event in _sse(http, f"{url}/v1/chat/completions", body)
                    if event.get("choices")])


async def _messages(http: httpx.AsyncClient, url: str) -> str:
    body = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count to three."}]}
    return "".join([event["delta"].get("text", "")
                    async for event in _sse(http, f"{url}/v1/messages", body)
                    if event.get("type") == "content_block_delta"])


async def _ollama(http: httpx.AsyncClient, url: str) -> str:
    body = {"model": "tiny", "stream": True,
            "options": {"temperature": 0, "num_predict": TOKENS},
            "messages": [{"role": "user", "content": "Say yes or no."}]}
    parts = []
    async with http.stream("POST", f"{url}/api/chat", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.strip():
                parts.append(json.loads(line).get("message", {}).get("content", ""))
    return "".join(parts)


async def _completions(http: httpx.AsyncClient, url: str) -> str:
    body = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0, "stream": True,
            "prompt": "Once upon a time"}
    return "".join([event["choices"][0].get("text", "")
                    async for event in _sse(http, f"{url}/v1/completions", body)
                    if event.get("choices")])


async def _sse(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                yield json.loads(data)


DOORS = (_chat, _messages, _ollama, _completions)


async def _together(url: str) -> list[str]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        return list(await asyncio.gather(*(door(http, url) for door in DOORS)))


async def _alone(url: str) -> list[str]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        return [await door(http, url) for door in DOORS]


def test_streams_through_four_doors_share_one_batch_and_keep_their_text(
        serve: Callable[..., tuple[LiveServer, Engine]],
        slow_steps: Callable[[float], None]) -> None:
    server, eng = serve()
    alone = asyncio.run(_alone(server.url))
    assert eng.stats().peak_running == 1
    slow_steps(0.03)  # so the four overlap however the machine schedules them
    together = asyncio.run(_together(server.url))
    assert together == alone
    assert all(alone), alone
    assert eng.stats().peak_running == len(DOORS)  # one step decoded a row of each door
