"""Concurrent HTTP requests reach the engine spread out in time; with an admission window
an idle server starts them as one prefill group (through real ``openai`` SDK streams)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from engine import StepProbe
from engine.core.step_probe import TurnReport

ADMITTED: list[tuple[int, ...]] = []


@pytest.fixture
def step_probe() -> StepProbe:
    """Overrides the server conftest's probe: this one records each turn's admissions."""
    ADMITTED.clear()

    def on_turn(report: TurnReport) -> None:
        if report.admitted:
            ADMITTED.append(report.admitted)

    return StepProbe(on_turn=on_turn)


async def _burst(base_url: str, n: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="tiny", max_tokens=4, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"burst request {i}"}])
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                        if chunk.choices])

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


async def test_a_burst_of_sdk_streams_starts_as_one_prefill_group(serve: Any) -> None:
    server, _ = serve(admission_window=1.0, prefill_batch=8)
    answers = await _burst(server.base_url, 8)
    assert len(answers) == 8
    # All eight in the first turn: the window waited for the seven behind the first and
    # ended when the group was full, well before its second.
    assert [len(turn) for turn in ADMITTED] == [8]
