"""Audio reaches the answer at every door, on the tiny Gemma 4 with an audio tower: LangChain's
``ChatMLXBatch`` (a v1 ``audio`` block), LlamaIndex's ``MLXBatchLLM`` (``AudioBlock`` from
bytes and from a path) and the server through the ``openai`` SDK (an ``input_audio`` part)
all give the engine's own answer for the same clip, and another clip changes it. The
profile says audio is read.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage

from mlx_providers import ChatMLXBatch, MLXBatchLLM
from tests.adapters.test_video_doors import answer_to
from tests.engine.test_audio_gemma4 import audio_part, tone_wav
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)
QUESTION = "What do you hear?"


@pytest.fixture(scope="module")
def chat(family_dirs: Callable[[str], Path]) -> Iterator[ChatMLXBatch]:
    model = ChatMLXBatch(model=str(family_dirs("gemma4")), max_tokens=8, temperature=0.0)
    yield model
    model.engine.close()


def engine_answer(chat: ChatMLXBatch, data: bytes) -> str:
    return answer_to(chat, audio_part(data), QUESTION)


def test_the_profile_says_audio_is_read(chat: ChatMLXBatch) -> None:
    assert chat.profile is not None and chat.profile["audio_inputs"]


def test_langchain_audio_block(chat: ChatMLXBatch) -> None:
    answers = []
    for tone in (440.0, 1200.0):
        data = tone_wav(1.0, tone)
        message = HumanMessage(content=[
            {"type": "audio", "base64": base64.b64encode(data).decode(),
             "mime_type": "audio/wav"}, {"type": "text", "text": QUESTION}])
        answers.append(chat.invoke([message]).content)
        assert answers[-1] == engine_answer(chat, data)
    assert answers[0] != answers[1]


async def test_langchain_audio_block_async(chat: ChatMLXBatch) -> None:
    data = tone_wav(0.7, 660.0)
    message = HumanMessage(content=[
        {"type": "audio", "base64": base64.b64encode(data).decode(),
         "mime_type": "audio/wav"}, {"type": "text", "text": QUESTION}])
    assert (await chat.ainvoke([message])).content == engine_answer(chat, data)


def test_llama_index_audio_block(chat: ChatMLXBatch, tmp_path: Path) -> None:
    from llama_index.core.base.llms.types import AudioBlock, ChatMessage, TextBlock

    llm = MLXBatchLLM(str(chat.engine.model_path), max_tokens=8, temperature=0.0)
    data = tone_wav(0.9, 300.0)
    saved = tmp_path / "clip.wav"
    saved.write_bytes(data)
    for block in (AudioBlock(audio=data, format="wav"), AudioBlock(path=saved)):
        answer = llm.chat([ChatMessage(role="user", blocks=[block, TextBlock(text=QUESTION)])])
        assert answer.message.content == engine_answer(chat, data)


@pytest.fixture(scope="module")
def server(chat: ChatMLXBatch) -> Iterator[LiveServer]:
    from mlx_providers.server import create_app

    live = LiveServer(create_app({"gemma4": chat.engine})).start()
    yield live
    live.stop()


def test_openai_sdk_input_audio(server: LiveServer, chat: ChatMLXBatch) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    data = tone_wav(1.2, 880.0)
    asked: Any = [{"role": "user", "content": [audio_part(data),
                                               {"type": "text", "text": QUESTION}]}]
    completion = client.chat.completions.create(model="gemma4", max_tokens=8, temperature=0.0,
                                                messages=asked)
    assert completion.choices[0].message.content == engine_answer(chat, data)
    long: Any = [{"role": "user", "content": [audio_part(tone_wav(31.0))]}]
    with pytest.raises(Exception, match="this model reads at most 30 s a clip"):
        client.chat.completions.create(model="gemma4", max_tokens=8, messages=long)
