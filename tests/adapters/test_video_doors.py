"""A video reaches the answer at every door, on a tiny Qwen3-VL: LangChain's ``ChatMLXBatch``
(a v1 ``video`` block), LlamaIndex's ``MLXBatchLLM`` (``VideoBlock`` from bytes and from a
path) and the server through the ``openai`` SDK (a ``video_url`` part) all give the engine's
own answer for the same clip, and another clip changes it. The profile says videos are read.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage

from engine import ChatRequest, SamplingParams
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from tests.engine.test_video import video_bytes, video_part
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)
QUESTION = "What happens in it?"


@pytest.fixture(scope="module")
def chat(family_dirs: Callable[[str], Path]) -> Iterator[ChatMLXBatch]:
    model = ChatMLXBatch(model=str(family_dirs("qwen3_vl")), max_tokens=8, temperature=0.0)
    yield model
    model.engine.close()


def answer_to(chat: ChatMLXBatch, part: dict[str, Any], question: str) -> str:
    """The engine's own greedy answer to a media ``part`` and a ``question`` (what every
    door must give)."""
    messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return chat.engine.submit(ChatRequest.from_openai(messages, params)).result(timeout=120).text


def engine_answer(chat: ChatMLXBatch, data: bytes) -> str:
    return answer_to(chat, video_part(data), QUESTION)


def test_the_profile_says_videos_are_read(chat: ChatMLXBatch) -> None:
    assert chat.profile is not None and chat.profile["video_inputs"]


def test_langchain_video_block(chat: ChatMLXBatch) -> None:
    answers = []
    for seed in (0, 1):
        data = video_bytes(seed)
        message = HumanMessage(content=[
            {"type": "video", "base64": base64.b64encode(data).decode(),
             "mime_type": "video/mp4"}, {"type": "text", "text": QUESTION}])
        answers.append(chat.invoke([message]).content)
        assert answers[-1] == engine_answer(chat, data)
    assert answers[0] != answers[1]


def test_llama_index_video_block(chat: ChatMLXBatch, tmp_path: Path) -> None:
    from llama_index.core.base.llms.types import ChatMessage, TextBlock, VideoBlock

    llm = MLXBatchLLM(str(chat.engine.model_path), max_tokens=8, temperature=0.0)
    data = video_bytes(2)
    saved = tmp_path / "clip.mp4"
    saved.write_bytes(data)
    for block in (VideoBlock(video=data, video_mimetype="video/mp4"), VideoBlock(path=saved)):
        answer = llm.chat([ChatMessage(role="user", blocks=[block, TextBlock(text=QUESTION)])])
        assert answer.message.content == engine_answer(chat, data)


@pytest.fixture(scope="module")
def server(chat: ChatMLXBatch) -> Iterator[LiveServer]:
    from mlx_providers.server import create_app

    live = LiveServer(create_app({"clip": chat.engine})).start()
    yield live
    live.stop()


def test_openai_sdk_video_url(server: LiveServer, chat: ChatMLXBatch) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    data = video_bytes(3)
    completion = client.chat.completions.create(model="clip", max_tokens=8, temperature=0.0,
                                                messages=[{"role": "user", "content": [
                                                    video_part(data),  # type: ignore[list-item]
                                                    {"type": "text", "text": QUESTION}]}])
    assert completion.choices[0].message.content == engine_answer(chat, data)
    remote = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
    with pytest.raises(Exception, match="remote video URLs are not fetched"):
        client.chat.completions.create(model="clip", max_tokens=8, messages=[
            {"role": "user", "content": [remote]}])  # type: ignore[list-item]
