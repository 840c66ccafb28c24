"""Images through Ollama's door (``images``: base64 beside a message's text) on the tiny
Gemma 3 VLM fitted to name an image's colour: different images, different answers, from
the ``ollama`` client (chat and generate), LangChain's ``ChatOllama`` and LlamaIndex's
``Ollama``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from langchain_core.messages import HumanMessage
from langchain_ollama import ChatOllama

from engine import ChatRequest, Engine, EngineConfig, SamplingParams
from mlx_providers.server import create_app
from testkit.vision_model import COLOURS, solid_image
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)
QUESTION = "What colour is this?"


def png(name: str, seed: int = 0) -> bytes:
    return solid_image(COLOURS[name], 40, noise=6, seed=seed + 50)


@pytest.fixture(scope="module")
def vlm(colour_vlm_dir: Path) -> Iterator[Engine]:
    eng = Engine(colour_vlm_dir, EngineConfig(max_batch=4)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(vlm: Engine) -> Iterator[LiveServer]:
    live = LiveServer(create_app({"colours": vlm}, embeddings={})).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


@pytest.mark.parametrize("name", ["red", "blue", "yellow"])
def test_chat_names_the_image_s_colour(client: ollama.Client, name: str) -> None:
    reply = client.chat(model="colours", options={"num_predict": 6}, messages=[
        {"role": "user", "content": QUESTION, "images": [png(name)]}])
    assert reply.message.content == name


def test_the_image_goes_before_the_text_as_the_engine_reads_it(client: ollama.Client,
                                                                vlm: Engine) -> None:
    encoded = base64.b64encode(png("green", 1)).decode()
    reply = client.chat(model="colours", options={"num_predict": 6}, messages=[
        {"role": "user", "content": QUESTION, "images": [encoded]}])
    want = vlm.submit(ChatRequest.from_openai([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}},
        {"type": "text", "text": QUESTION}]}], SamplingParams(max_tokens=6))).result(60)
    assert reply.message.content == want.content == "green"
    assert reply.prompt_eval_count == want.usage.prompt_tokens
    streamed = "".join(c.message.content or "" for c in client.chat(
        model="colours", stream=True, options={"num_predict": 6},
        messages=[{"role": "user", "content": QUESTION, "images": [encoded]}]))
    assert streamed == "green"


def test_generate_with_images(client: ollama.Client) -> None:
    reply = client.generate(model="colours", prompt=QUESTION, images=[png("blue", 2)],
                            options={"num_predict": 6})
    assert reply.response == "blue"
    with pytest.raises(ollama.ResponseError) as raised:
        client.generate(model="colours", prompt=QUESTION, images=[b"not an image"],
                        options={"num_predict": 6})
    assert raised.value.status_code == 400 and "images[0]" in raised.value.error


def test_chat_ollama_sends_an_image_block(server: LiveServer) -> None:
    llm = ChatOllama(model="colours", base_url=server.url, num_predict=6)
    message = HumanMessage(content=[
        {"type": "image_url",
         "image_url": f"data:image/png;base64,{base64.b64encode(png('red', 3)).decode()}"},
        {"type": "text", "text": QUESTION}])
    assert llm.invoke([message]).content == "red"


def test_llama_index_sends_an_image_block(server: LiveServer) -> None:
    from llama_index.core.llms import ChatMessage, ImageBlock, TextBlock
    from llama_index.llms.ollama import Ollama

    llm = Ollama(model="colours", base_url=server.url, request_timeout=120,
                 context_window=2048, additional_kwargs={"num_predict": 6})
    response = llm.chat([ChatMessage(role="user", blocks=[
        ImageBlock(image=png("yellow", 4)), TextBlock(text=QUESTION)])])
    assert response.message.content == "yellow"
