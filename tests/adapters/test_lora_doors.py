"""A LoRA adapter per request at every door, on one shared engine over the tiny model:
``ChatMLXBatch(adapter=...)`` and per call, ``MLXBatchLLM(adapter=...)``, and the server
through the ``openai`` SDK (a registered adapter as ``model="tiny:name"`` or in the
``adapter`` field), each equal to the engine's own tokens with that adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage

from engine import ChatRequest, Engine, SamplingParams
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from testkit.adapters import make_adapter
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(300)
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("door-adapters")
    return {"a": str(make_adapter(root / "a", tiny_model_dir, seed=21)),
            "b": str(make_adapter(root / "b", tiny_model_dir, seed=22, rank=4))}


@pytest.fixture(scope="module")
def chat(tiny_model_dir: Path) -> Iterator[ChatMLXBatch]:
    model = ChatMLXBatch(model=str(tiny_model_dir), max_tokens=8, temperature=0.0)
    yield model
    model.engine.close()


def engine_text(engine: Engine, adapter: str | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)
    return engine.submit(ChatRequest.from_openai(QUESTION, params)).result(timeout=60).content


def test_chat_model_field_and_per_call(chat: ChatMLXBatch, tiny_model_dir: Path,
                                       adapters: dict[str, str]) -> None:
    expected = {name: engine_text(chat.engine, path)
                for name, path in [("base", None), *adapters.items()]}
    assert len(set(expected.values())) == 3  # each adapter changes the answer
    with_a = ChatMLXBatch(model=str(tiny_model_dir), max_tokens=8, temperature=0.0,
                          adapter=adapters["a"])
    assert with_a.engine is chat.engine  # one engine, one copy of the base weights
    assert with_a.invoke([HumanMessage(QUESTION[0]["content"])]).content == expected["a"]
    assert with_a.invoke([HumanMessage(QUESTION[0]["content"])],
                         adapter=adapters["b"]).content == expected["b"]
    assert chat.invoke([HumanMessage(QUESTION[0]["content"])]).content == expected["base"]


def test_llama_index_llm_field(chat: ChatMLXBatch, tiny_model_dir: Path,
                               adapters: dict[str, str]) -> None:
    from llama_index.core.base.llms.types import ChatMessage

    llm = MLXBatchLLM(str(tiny_model_dir), max_tokens=8, temperature=0.0,
                      adapter=adapters["b"])
    answer = llm.chat([ChatMessage(role="user", content=QUESTION[0]["content"])])
    assert answer.message.content == engine_text(chat.engine, adapters["b"])


@pytest.fixture(scope="module")
def server(chat: ChatMLXBatch, adapters: dict[str, str]) -> Iterator[LiveServer]:
    from mlx_providers.server import ServerSettings, create_app

    live = LiveServer(create_app({"tiny": chat.engine},
                                 settings=ServerSettings(adapters=adapters))).start()
    yield live
    live.stop()


def test_the_server_routes_adapters(server: LiveServer, chat: ChatMLXBatch,
                                    adapters: dict[str, str]) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    assert [m.id for m in client.models.list()] == ["tiny", "tiny:a", "tiny:b"]
    named = client.chat.completions.create(model="tiny:a", max_tokens=8, messages=QUESTION)
    assert named.choices[0].message.content == engine_text(chat.engine, adapters["a"])
    by_field = client.responses.create(model="tiny", max_output_tokens=8, input=QUESTION,
                                       extra_body={"adapter": "b"})
    assert by_field.output_text == engine_text(chat.engine, adapters["b"])
    # A directory is no registered name (only --allow-adapter-paths loads one).
    with pytest.raises(openai.BadRequestError, match="not a registered adapter") as raised:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=QUESTION,
                                       extra_body={"adapter": adapters["b"]})
    assert raised.value.body["param"] == "adapter"  # type: ignore[index]
