"""Features combined in one request, at every door: the same answer as the engine's.

The matrix (tests/engine/test_crossings.py) proves each pair on the engine; here a few
combinations agents send come in through ``ChatMLXBatch``, ``MLXBatchLLM`` and the
server's chat completions and Responses (the ``openai`` SDK over loopback), whole and
streamed, on one shared engine over the matrix's tiny reasoning Qwen2-VL: an image with an
adapter and logprobs, an image with a forced call, an adapter with a schema, an image under
a reasoning budget. Each door's text, reasoning and calls equal the engine's own.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage

from engine import ChatRequest, Completion, Engine, JsonSchema, SamplingParams
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from testkit.crossings import (
    MATRIX_MODEL,
    SYSTEM,
    THINK_ON,
    VERDICT,
    WEATHER,
    build_matrix_vlm,
)
from testkit.vision_model import solid_image
from tests.conftest import _built, _cache_root, _vision_stack
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(600)

QUESTION = "What is the weather in Paris?"
PNG = solid_image((30, 40, 220), 60, noise=20, seed=4)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _vision_stack()
    return _built(_cache_root(tmp_path_factory) / MATRIX_MODEL, build_matrix_vlm)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> str:
    from testkit.adapters import make_adapter

    return str(make_adapter(tmp_path_factory.mktemp("door-crossings") / "a", model_dir,
                            seed=9, rank=4))


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> Iterator[ChatMLXBatch]:
    model = ChatMLXBatch(model=str(model_dir), max_tokens=TOKENS, temperature=0.0)
    yield model
    model.engine.close()


@pytest.fixture(scope="module")
def server(chat: ChatMLXBatch, adapter: str) -> Iterator[LiveServer]:
    from mlx_providers.server import ServerSettings, create_app

    live = LiveServer(create_app({"vlm": chat.engine},
                                 settings=ServerSettings(adapters={"a": adapter}))).start()
    yield live
    live.stop()


def engine_reply(engine: Engine, image: bool, tools: bool = False, **params: Any,
                 ) -> Completion:
    template = params.pop("chat_template_kwargs", None)
    content: Any = ([{"type": "image_url", "image_url": {"url": DATA_URL}},
                     {"type": "text", "text": QUESTION}] if image else QUESTION)
    request = ChatRequest.from_openai(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        SamplingParams(temperature=0.0, **{"max_tokens": TOKENS, **params}),
        tools=[WEATHER] if tools else None, tool_choice="required" if tools else None,
        chat_template_kwargs=template)
    return engine.submit(request).result(timeout=120)


def lc_messages(image: bool) -> list[Any]:
    content: Any = ([{"type": "image_url", "image_url": {"url": DATA_URL}},
                     {"type": "text", "text": QUESTION}] if image else QUESTION)
    return [SystemMessage(SYSTEM), HumanMessage(content)]


def li_messages(image: bool) -> list[Any]:
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    blocks: list[Any] = [TextBlock(text=QUESTION)]
    if image:
        blocks.insert(0, ImageBlock(image=PNG, image_mimetype="image/png"))
    return [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", blocks=blocks)]


def openai_messages(image: bool) -> list[dict[str, Any]]:
    content: Any = ([{"type": "image_url", "image_url": {"url": DATA_URL}},
                     {"type": "text", "text": QUESTION}] if image else QUESTION)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def responses_input(image: bool) -> list[dict[str, Any]]:
    content: Any = ([{"type": "input_image", "image_url": DATA_URL},
                     {"type": "input_text", "text": QUESTION}] if image else QUESTION)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def streamed(chunks: Iterator[AIMessageChunk]) -> AIMessageChunk:
    total: AIMessageChunk | None = None
    for chunk in chunks:
        total = chunk if total is None else total + chunk
    assert total is not None
    return total


def test_an_image_with_an_adapter_and_logprobs(chat: ChatMLXBatch, server: LiveServer,
                                               adapter: str, model_dir: Path) -> None:
    expected = engine_reply(chat.engine, True, adapter=adapter, logprobs=True, top_logprobs=2)
    assert expected.content != engine_reply(chat.engine, True).content  # the adapter counts
    tuned = ChatMLXBatch(model=str(model_dir), max_tokens=TOKENS, temperature=0.0,
                         adapter=adapter, logprobs=True, top_logprobs=2)
    assert tuned.engine is chat.engine
    whole = tuned.invoke(lc_messages(True))
    assert whole.content == expected.content
    assert len(whole.response_metadata["logprobs"]["content"]) == len(expected.token_ids)
    assert streamed(tuned.stream(lc_messages(True))).content == expected.content
    llm = MLXBatchLLM(str(model_dir), max_tokens=TOKENS, temperature=0.0, adapter=adapter,
                      logprobs=True, top_logprobs=2)
    answer = llm.chat(li_messages(True))
    assert answer.message.content == expected.content
    assert len(answer.logprobs or []) == len(expected.token_ids)
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    reply = client.chat.completions.create(model="vlm:a", max_tokens=TOKENS, logprobs=True,
                                           top_logprobs=2, messages=openai_messages(True))
    assert reply.choices[0].message.content == expected.content
    assert reply.choices[0].logprobs is not None
    assert len(reply.choices[0].logprobs.content or []) == len(expected.token_ids)
    pieces = client.chat.completions.create(model="vlm:a", max_tokens=TOKENS, stream=True,
                                            messages=openai_messages(True))
    assert "".join(c.choices[0].delta.content or "" for c in pieces
                   if c.choices) == expected.content
    response = client.responses.create(model="vlm:a", max_output_tokens=TOKENS,
                                       input=responses_input(True), top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    assert response.output_text == expected.content


def test_an_image_with_a_forced_call_streamed(chat: ChatMLXBatch, server: LiveServer,
                                              model_dir: Path) -> None:
    expected = engine_reply(chat.engine, True, tools=True, max_tokens=60)
    assert len(expected.tool_calls) == 1
    call = expected.tool_calls[0]
    model = ChatMLXBatch(model=str(model_dir), max_tokens=60, temperature=0.0)
    bound = model.bind_tools([WEATHER], tool_choice="required")
    for message in (bound.invoke(lc_messages(True)), streamed(bound.stream(lc_messages(True)))):
        assert [(c["name"], c["args"]) for c in message.tool_calls] == [
            (call.name, call.arguments)]
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    pieces = client.chat.completions.create(
        model="vlm", max_tokens=60, stream=True, messages=openai_messages(True),
        tools=[WEATHER], tool_choice="required")
    arguments = "".join(t.function.arguments or "" for c in pieces if c.choices
                        for t in (c.choices[0].delta.tool_calls or []) if t.function)
    assert json.loads(arguments) == call.arguments
    with client.responses.stream(model="vlm", max_output_tokens=60,
                                 input=responses_input(True), tool_choice="required",
                                 tools=[{"type": "function", **WEATHER["function"]}]) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(call.name, call.arguments)]


def test_an_adapter_with_a_schema_streamed(chat: ChatMLXBatch, server: LiveServer,
                                           adapter: str, model_dir: Path) -> None:
    expected = engine_reply(chat.engine, False, adapter=adapter, max_tokens=60,
                            constraint=JsonSchema(VERDICT))
    tuned = ChatMLXBatch(model=str(model_dir), max_tokens=60, temperature=0.0,
                         adapter=adapter)
    structured = tuned.with_structured_output(VERDICT, method="json_schema")
    if expected.finish_reason.value == "stop":
        assert structured.invoke(lc_messages(False)) == json.loads(expected.content)
    bound = tuned.bind(response_format={"type": "json_schema", "json_schema": {
        "name": "verdict", "schema": VERDICT}})
    assert streamed(bound.stream(lc_messages(False))).content == expected.content
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    pieces = client.chat.completions.create(
        model="vlm:a", max_tokens=60, stream=True, messages=openai_messages(False),
        response_format={"type": "json_schema", "json_schema": {"name": "verdict",
                                                                "schema": VERDICT}})
    assert "".join(c.choices[0].delta.content or "" for c in pieces
                   if c.choices) == expected.content


def test_an_image_under_a_reasoning_budget(chat: ChatMLXBatch, server: LiveServer,
                                           model_dir: Path) -> None:
    thinking = dict(THINK_ON)
    expected = engine_reply(chat.engine, True, max_tokens=16, reasoning_budget=3,
                            chat_template_kwargs=thinking)
    assert expected.usage.reasoning_tokens == 3
    model = ChatMLXBatch(model=str(model_dir), max_tokens=16, temperature=0.0,
                         reasoning_budget=3, chat_template_kwargs=thinking)
    whole = model.invoke(lc_messages(True))
    assert whole.content == expected.content
    assert whole.additional_kwargs.get("reasoning_content", "") == expected.reasoning
    llm = MLXBatchLLM(str(model_dir), max_tokens=16, temperature=0.0, reasoning_budget=3,
                      chat_template_kwargs=thinking)
    assert llm.chat(li_messages(True)).message.content == expected.content
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    reply = client.chat.completions.create(
        model="vlm", max_tokens=16, messages=openai_messages(True),
        extra_body={"reasoning_budget": 3, "chat_template_kwargs": thinking})
    assert reply.choices[0].message.content == expected.content
