"""The async doors read images off the event loop: decoding a large image (a 12 MP PNG takes
the better part of a second) happens on a worker thread, while a ticker on the caller's
loop keeps ticking. On the tiny random-weight Gemma 3 VLM, one engine for all doors.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

from engine.requests.inbound import images
from mlx_providers import ChatMLXBatch, MLXBatchLLM

pytestmark = pytest.mark.timeout(600)
QUESTION = "What is it?"


@pytest.fixture(scope="module")
def large_png() -> bytes:
    """A 4000x3000 PNG of noise (compressed fast: noise does not compress anyway)."""
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def doors(tiny_vlm_dir: Path) -> Iterator[tuple[ChatMLXBatch, MLXBatchLLM]]:
    chat = ChatMLXBatch(model=str(tiny_vlm_dir), max_tokens=2, temperature=0.0)
    llm = MLXBatchLLM(str(tiny_vlm_dir), max_tokens=2, temperature=0.0)
    chat.invoke("Hello")  # the model loaded before any loop is watched
    yield chat, llm
    chat.engine.close()


# A door's call, its messages built first (outside the measured span: building them is the
# caller's own work, e.g. base64 of the bytes), returning what awaits the answer.
Door = Callable[[ChatMLXBatch, MLXBatchLLM, bytes, Path], Callable[[], Awaitable[Any]]]


def langchain_ainvoke(chat: ChatMLXBatch, llm: MLXBatchLLM, png: bytes,
                      tmp: Path) -> Callable[[], Awaitable[Any]]:
    message = HumanMessage(content=[
        {"type": "image", "base64": base64.b64encode(png).decode(), "mime_type": "image/png"},
        {"type": "text", "text": QUESTION}])
    return lambda: chat.ainvoke([message])


def langchain_ainvoke_dicts(chat: ChatMLXBatch, llm: MLXBatchLLM, png: bytes,
                            tmp: Path) -> Callable[[], Awaitable[Any]]:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]
    return lambda: chat.ainvoke(messages)


def langchain_astream(chat: ChatMLXBatch, llm: MLXBatchLLM, png: bytes,
                      tmp: Path) -> Callable[[], Awaitable[Any]]:
    message = HumanMessage(content=[
        {"type": "image_url",
         "image_url": {"url": f"data:image/png;base64,{base64.b64encode(png).decode()}"}},
        {"type": "text", "text": QUESTION}])

    async def streamed() -> Any:
        return [chunk async for chunk in chat.astream([message])]

    return streamed


def llama_index_achat(chat: ChatMLXBatch, llm: MLXBatchLLM, png: bytes,
                      tmp: Path) -> Callable[[], Awaitable[Any]]:
    message = ChatMessage(role="user", blocks=[
        ImageBlock(image=png, image_mimetype="image/png"), TextBlock(text=QUESTION)])
    return lambda: llm.achat([message])


def llama_index_astream_chat(chat: ChatMLXBatch, llm: MLXBatchLLM, png: bytes,
                             tmp: Path) -> Callable[[], Awaitable[Any]]:
    path = tmp / "screenshot.png"  # read from disk on the worker thread too
    path.write_bytes(png)
    message = ChatMessage(role="user", blocks=[
        ImageBlock(path=path, image_mimetype="image/png"), TextBlock(text=QUESTION)])

    async def streamed() -> Any:
        return [chunk async for chunk in await llm.astream_chat([message])]

    return streamed


@pytest.mark.parametrize("call", [langchain_ainvoke, langchain_ainvoke_dicts,
                                  langchain_astream, llama_index_achat,
                                  llama_index_astream_chat], ids=lambda c: c.__name__)
async def test_a_large_image_is_decoded_off_the_event_loop(
        doors: tuple[ChatMLXBatch, MLXBatchLLM], large_png: bytes, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, call: Door) -> None:
    loop_thread = threading.current_thread()
    decoded_on: list[threading.Thread] = []
    real = images._decode

    def recorded(*args: Any, **kwargs: Any) -> Any:
        decoded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(images, "_decode", recorded)
    monkeypatch.setattr(images, "_seen", OrderedDict())  # no decode skipped as seen before
    done = asyncio.Event()
    gaps: list[float] = []

    async def ticker() -> None:  # what any other task on the caller's loop experiences
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    answering = call(*doors, large_png, tmp_path)
    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)  # the ticker runs before the call starts
    try:
        answer = await answering()
    finally:
        done.set()
        await ticking
    assert answer
    assert decoded_on, "the image was never decoded"
    # Every decode ran on a worker thread (or the engine's), never on the loop's thread.
    assert loop_thread not in decoded_on, f"decoded on the loop; max gap {max(gaps):.3f} s"
    print(f"{call.__name__}: the loop's longest gap {max(gaps) * 1000:.0f} ms")
