"""Images on the Messages door through the real ``anthropic`` SDK, on the tiny random-weight
Gemma 3 vision model: an ``image`` block (base64, or a ``url`` source holding a data: URI)
and an image inside a ``tool_result`` answer as the engine does for the same OpenAI-shaped
request; a remote URL is refused naming the block (the engine fetches nothing)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from engine import ChatRequest, Completion, Engine, EngineConfig, SamplingParams
from mlx_providers.server import create_app
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def png() -> bytes:
    from testkit.vision_model import solid_image

    return solid_image((200, 40, 30), 48, noise=12, seed=3)


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir: Path) -> Iterator[Engine]:
    eng = Engine(tiny_vlm_dir, EngineConfig(max_batch=4, prefill_chunk=64)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(vlm_engine: Engine) -> Iterator[anthropic.Anthropic]:
    server = LiveServer(create_app({"vlm": vlm_engine})).start()
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=120) as sdk:
        yield sdk
    server.stop()


def own(eng: Engine, messages: list[dict[str, Any]], **options: Any) -> Completion:
    return eng.submit(ChatRequest.from_openai(messages, SamplingParams(max_tokens=8),
                                              **options)).result(timeout=120)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_an_image_block_is_read_as_the_engine_reads_an_image(
        client: anthropic.Anthropic, vlm_engine: Engine, png: bytes) -> None:
    data = base64.b64encode(png).decode()
    expected = own(vlm_engine, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "What colour is this?"}]}])
    for source in ({"type": "base64", "media_type": "image/png", "data": data},
                   {"type": "url", "url": f"data:image/png;base64,{data}"}):
        message = client.messages.create(model="vlm", max_tokens=8, messages=[{
            "role": "user", "content": [{"type": "image", "source": source},  # type: ignore[list-item]
                                        {"type": "text", "text": "What colour is this?"}]}])
        assert text_of(message) == expected.content
        assert message.usage.output_tokens == expected.usage.completion_tokens
    text_only = own(vlm_engine, [{"role": "user", "content": "What colour is this?"}])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > (
        text_only.usage.prompt_tokens)  # the image's tokens are in the prompt


def test_an_image_in_a_tool_result(client: anthropic.Anthropic, vlm_engine: Engine,
                                   png: bytes) -> None:
    data = base64.b64encode(png).decode()
    tool: Any = {"name": "screenshot", "description": "Take a screenshot.",
                 "input_schema": {"type": "object", "properties": {}}}
    history: Any = [{"role": "user", "content": "Look at the screen."},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "screenshot",
                         "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": [
                                                      {"type": "text", "text": "Here:"},
                                                      {"type": "image", "source": {
                                                          "type": "base64",
                                                          "media_type": "image/png",
                                                          "data": data}}]}]}]
    message = client.messages.create(model="vlm", max_tokens=8, messages=history,
                                     tools=[tool])
    expected = own(vlm_engine, [
        {"role": "user", "content": "Look at the screen."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                             "function": {"name": "screenshot",
                                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "screenshot", "content": [
            {"type": "text", "text": "Here:"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}],
        tools=[{"type": "function", "function": {"name": "screenshot",
                                                 "description": "Take a screenshot.",
                                                 "parameters": tool["input_schema"]}}])
    assert text_of(message) == expected.content
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (c.name, c.arguments) for c in expected.tool_calls]


def test_a_remote_image_url_is_refused_naming_the_block(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError,
                       match=r"messages\[0\]\.content\[1\]: remote image URLs are not fetched"):
        client.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
