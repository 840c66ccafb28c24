"""MLXBatchLLM batching and cancellation on the tiny model, checked through engine.stats()."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool

from engine import EngineStats
from mlx_providers import MLXBatchLLM
from tests.conftest import own_copy, wait_until

LONG = 1500  # tokens: far more than a test waits for, so only a cancel ends these rows


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_copy(tiny_model_dir, tmp_path_factory.mktemp("li-batch") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[MLXBatchLLM]:
    model = MLXBatchLLM(model_dir, max_tokens=24, engine_config={"max_batch": 16})
    yield model
    model.engine.close()


def ask(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


QUESTIONS = [f"Question {i}: what is {i} plus {i}?" for i in range(10)]


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait without blocking the event loop (the engine thread does the work)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout:.0f} s")
        await asyncio.sleep(0.005)


def idle(llm: MLXBatchLLM) -> bool:
    stats = llm.engine.stats()
    return stats.running == 0 and stats.pending == 0


async def settled(llm: MLXBatchLLM) -> EngineStats:
    """Stats once earlier requests are off the books (a result can beat the stats update)."""
    await until(lambda: idle(llm))
    return llm.engine.stats()


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# ----- transparent batching -----------------------------------------------------------


async def test_concurrent_agents_become_rows_of_one_batch(llm: MLXBatchLLM) -> None:
    before = await settled(llm)
    agents = [FunctionAgent(name=f"agent{i}", description="adds", tools=[
        FunctionTool.from_defaults(add)], llm=llm, streaming=False) for i in range(10)]
    results = await asyncio.gather(*(agent.run(user_msg=q)
                                     for agent, q in zip(agents, QUESTIONS)))
    after = await settled(llm)
    assert all(isinstance(str(r), str) for r in results)
    assert after.peak_running >= 8
    assert after.completed - before.completed >= 10


async def test_langchain_and_llama_index_share_one_engine(llm: MLXBatchLLM,
                                                          model_dir: Path) -> None:
    langchain = pytest.importorskip(
        "mlx_providers.langchain", reason="ChatMLXBatch (mlx_providers/langchain.py) is missing")
    chat = langchain.ChatMLXBatch(model=str(model_dir), max_tokens=24)
    assert chat.engine is llm.engine
    before = (await settled(llm)).completed
    lc, li = await asyncio.gather(chat.ainvoke("Hello there"), llm.achat(ask("Hello there")))
    assert lc.content == li.message.content  # the same model and prompt: the same answer
    assert (await settled(llm)).completed - before == 2


# ----- cancellation -------------------------------------------------------------------


async def test_cancelling_achat_evicts_the_row_and_spares_siblings(llm: MLXBatchLLM) -> None:
    siblings = [ask(q) for q in QUESTIONS[:4]]
    alone = [(await llm.achat(m, max_tokens=48)).message.content for m in siblings]
    before = await settled(llm)
    victim = asyncio.ensure_future(llm.achat(ask("Tell me a long story."), max_tokens=LONG))
    await until(lambda: llm.engine.stats().running == 1)
    others = asyncio.gather(*(llm.achat(m, max_tokens=48) for m in siblings))
    await until(lambda: llm.engine.stats().running == 5)
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    together = [r.message.content for r in await others]
    assert together == alone
    after = await settled(llm)
    assert after.cancelled - before.cancelled == 1
    assert after.completed - before.completed == 4


async def test_cancelling_the_task_driving_astream_chat_evicts_the_row(
        llm: MLXBatchLLM) -> None:
    before = await settled(llm)
    seen: list[str] = []

    async def consume() -> None:
        async for chunk in await llm.astream_chat(ask("Go on."), max_tokens=LONG):
            seen.append(chunk.delta or "")

    task = asyncio.ensure_future(consume())
    await until(lambda: len(seen) >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await settled(llm)).cancelled - before.cancelled == 1


async def test_abandoning_async_streams_evicts_their_rows(llm: MLXBatchLLM) -> None:
    before = await settled(llm)
    chat = await llm.astream_chat(ask("Go on."), max_tokens=LONG)
    text = await llm.astream_complete("Once upon a time", max_tokens=LONG)
    async for _chunk in chat:
        break
    async for _chunk in text:
        break
    await until(lambda: llm.engine.stats().running == 2)
    del chat, text  # dropped without aclose(): the loop's generator finaliser closes them
    gc.collect()
    assert (await settled(llm)).cancelled - before.cancelled == 2


def test_abandoning_sync_streams_evicts_their_rows(llm: MLXBatchLLM) -> None:
    wait_until(lambda: idle(llm))
    before = llm.engine.stats()
    chat = llm.stream_chat(ask("Go on."), max_tokens=LONG)
    text = llm.stream_complete("Once upon a time", max_tokens=LONG)
    next(chat), next(text)
    wait_until(lambda: llm.engine.stats().running == 2)
    del chat, text
    gc.collect()
    wait_until(lambda: idle(llm))
    assert llm.engine.stats().cancelled - before.cancelled == 2


async def test_cancel_run_of_an_agent_evicts_its_row(llm: MLXBatchLLM, model_dir: Path) -> None:
    before = await settled(llm)
    talker = MLXBatchLLM(model_dir, max_tokens=LONG)  # no config: reuses the module's engine
    agent = FunctionAgent(name="talker", description="talks", llm=talker,
                          tools=[FunctionTool.from_defaults(add)])
    handler = agent.run(user_msg="Tell me everything.")
    await until(lambda: llm.engine.stats().running == 1)
    await handler.cancel_run()
    after = await settled(llm)
    assert after.cancelled - before.cancelled == 1
    assert after.completed == before.completed
