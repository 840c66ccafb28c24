"""An image reaches the answer at every door, on a tiny Gemma 3 VLM fitted to name a colour.

Different images, different answers: LangChain's ``ChatMLXBatch`` (invoke, stream, a tool
result holding a screenshot), LlamaIndex's ``MLXBatchLLM`` (chat, and a ``FunctionAgent``
whose tool returns an image) and the server through the ``openai`` SDK (chat completions
and Responses), all on one shared engine.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from mlx_providers import ChatMLXBatch, MLXBatchLLM
from testkit.vision_model import COLOURS, solid_image
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)
QUESTION = "What colour is this?"


def png(name: str, seed: int = 0) -> bytes:
    return solid_image(COLOURS[name], 40, noise=6, seed=seed + 50)


def b64(name: str, seed: int = 0) -> str:
    return base64.b64encode(png(name, seed)).decode()


@pytest.fixture(scope="module")
def chat(colour_vlm_dir: Path) -> Iterator[ChatMLXBatch]:
    model = ChatMLXBatch(model=str(colour_vlm_dir), max_tokens=6, temperature=0.0)
    yield model
    model.engine.close()


def test_the_profile_says_images_are_read(chat: ChatMLXBatch) -> None:
    assert chat.profile is not None
    assert chat.profile["image_inputs"] and chat.profile["image_tool_message"]


@pytest.mark.parametrize("name", ["red", "blue", "yellow"])
def test_chat_model_invoke_names_the_colour(chat: ChatMLXBatch, name: str) -> None:
    message = HumanMessage(content=[
        {"type": "image", "base64": b64(name), "mime_type": "image/png"},
        {"type": "text", "text": QUESTION}])
    assert chat.invoke([message]).content == name


def test_chat_model_stream_with_an_openai_style_part(chat: ChatMLXBatch) -> None:
    message = HumanMessage(content=[
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64('green')}"}},
        {"type": "text", "text": QUESTION}])
    assert "".join(str(chunk.content) for chunk in chat.stream([message])) == "green"


@pytest.mark.parametrize("name", ["green", "blue"])
def test_a_screenshot_in_a_tool_result_reaches_the_answer(chat: ChatMLXBatch,
                                                          name: str) -> None:
    history = [
        HumanMessage("What colour is the screenshot?"),
        AIMessage("", tool_calls=[{"id": "call_7", "name": "take_screenshot", "args": {}}]),
        ToolMessage(content=[{"type": "image", "base64": b64(name, 1),
                              "mime_type": "image/png"}], tool_call_id="call_7"),
    ]
    assert chat.invoke(history).content == name


def test_llama_index_chat_with_an_image_block(colour_vlm_dir: Path, tmp_path: Path) -> None:
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    llm = MLXBatchLLM(str(colour_vlm_dir), max_tokens=6, temperature=0.0)
    saved = tmp_path / "shot.png"
    saved.write_bytes(png("yellow"))
    answers = [llm.chat([ChatMessage(role="user", blocks=[block, TextBlock(text=QUESTION)])])
               .message.content
               for block in (ImageBlock(image=png("red")), ImageBlock(path=saved),
                             ImageBlock(url=f"data:image/png;base64,{b64('blue')}"))]
    assert answers == ["red", "yellow", "blue"]


async def test_a_function_agent_whose_tool_returns_an_image(colour_vlm_dir: Path) -> None:
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole
    from llama_index.core.tools import FunctionTool

    class CallsFirst(MLXBatchLLM):
        """The tiny model cannot choose a call by itself: its first turn must call a tool
        (tool_required, as an agent that needs the screenshot would); then it answers."""

        def _prepare_chat_with_tools(self, tools: Any, user_msg: Any = None,
                                     chat_history: Any = None, verbose: bool = False,
                                     allow_parallel_tool_calls: bool = False,
                                     tool_required: bool = False, **kwargs: Any,
                                     ) -> dict[str, Any]:
            history: list[ChatMessage] = list(chat_history or [])
            answered = any(m.role == MessageRole.TOOL for m in history)
            return super()._prepare_chat_with_tools(
                tools, user_msg, chat_history, verbose, allow_parallel_tool_calls,
                tool_required=not answered, **kwargs)

    def take_screenshot() -> ImageBlock:
        """Take a screenshot of the screen."""
        return ImageBlock(image=png("red", 3), image_mimetype="image/png")

    llm = CallsFirst(str(colour_vlm_dir), max_tokens=24, temperature=0.0)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(take_screenshot)], llm=llm)
    handler = agent.run("What colour is the screenshot?")
    called = [event async for event in handler.stream_events()
              if isinstance(event, ToolCallResult)]
    result = await handler
    assert [c.tool_name for c in called] == ["take_screenshot"]
    assert str(result.response.content) == "red"


@pytest.fixture(scope="module")
def server(chat: ChatMLXBatch) -> Iterator[LiveServer]:
    from mlx_providers.server import create_app

    live = LiveServer(create_app({"colour": chat.engine})).start()
    yield live
    live.stop()


def test_openai_sdk_chat_and_responses(server: LiveServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    for name in ("blue", "red"):
        url = f"data:image/png;base64,{b64(name, 2)}"
        completion = client.chat.completions.create(model="colour", max_tokens=6, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}])
        assert completion.choices[0].message.content == name
        response = client.responses.create(model="colour", max_output_tokens=6, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": url,
                                          "detail": "auto"},
                                         {"type": "input_text", "text": QUESTION}]}])
        assert response.output_text == name
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    counted = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("mlx_engine_vision_") and 'model="colour"' in line}
    # Blue and red read once each; their second request resumed the first's cached prefix,
    # image included, so it needed neither the tower nor the feature LRU.
    assert counted["mlx_engine_vision_images_total"] >= 2
    assert counted["mlx_engine_vision_seconds_total"] > 0
    assert "mlx_engine_vision_feature_hits_total" in counted


def test_the_server_refuses_a_remote_image_with_a_400(server: LiveServer) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    with pytest.raises(openai.BadRequestError, match="not fetched") as raised:
        client.chat.completions.create(model="colour", max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert raised.value.body["param"] == "messages[0].content[0]"  # type: ignore[index]


class _ImageSuite(ChatModelIntegrationTests):
    """LangChain's standard image tests, asked of the colour VLM (``supports_image_*``)."""

    @property
    def chat_model_class(self) -> type[ChatMLXBatch]:
        return ChatMLXBatch

    @property
    def supports_image_inputs(self) -> bool:
        return True

    @property
    def supports_image_tool_message(self) -> bool:
        return True


def test_langchain_standard_image_tests_pass(chat: ChatMLXBatch,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite fetches a PNG from GitHub; this machine has no network, so the fetch is
    # answered with a local PNG. Everything else is the suite's own test, as written.
    picture = png("blue", 4)

    class Fetched:
        content = picture

    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: Fetched())
    suite = _ImageSuite()
    suite.test_image_inputs(chat)
    suite.test_image_tool_message(chat)
    assert chat.engine.stats().vision_images >= 1
