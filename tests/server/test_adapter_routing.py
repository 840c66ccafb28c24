"""LoRA adapters at the server, through the ``openai`` SDK over loopback: only registered
adapters are served (``--adapter name=dir``, as ``model="base:name"`` or the ``adapter``
field); a directory a request names loads only with ``allow_adapter_paths``; a refusal
lists the registered names and says nothing of the server's files; ``/v1/models`` lists
each id once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import ChatRequest, Engine, SamplingParams
from mlx_providers.server import ServerSettings, create_app
from testkit.adapters import make_adapter
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(300)
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("routed-adapters")
    return {"a": str(make_adapter(root / "a", tiny_model_dir, seed=31)),
            "b": str(make_adapter(root / "b", tiny_model_dir, seed=32, rank=4))}


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def registered(server_engine: Engine, adapters: dict[str, str]) -> Iterator[openai.OpenAI]:
    """A server with adapter ``a`` registered, and paths not allowed (the default)."""
    live = LiveServer(create_app({"tiny": server_engine}, settings=ServerSettings(
        adapters={"a": adapters["a"]}))).start()
    yield client_of(live)
    live.stop()


def engine_text(engine: Engine, adapter: str | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)
    return engine.submit(ChatRequest.from_openai(QUESTION, params)).result(timeout=60).content


def test_a_registered_adapter_is_served_by_its_name(registered: openai.OpenAI,
                                                    server_engine: Engine,
                                                    adapters: dict[str, str]) -> None:
    expected = engine_text(server_engine, adapters["a"])
    assert expected != engine_text(server_engine, None)  # the adapter changes the answer
    named = registered.chat.completions.create(model="tiny:a", max_tokens=8,
                                               messages=QUESTION)  # type: ignore[arg-type]
    assert named.choices[0].message.content == expected
    by_field = registered.responses.create(model="tiny", max_output_tokens=8, input=QUESTION,  # type: ignore[arg-type]
                                           extra_body={"adapter": "a"})
    assert by_field.output_text == expected


@pytest.mark.parametrize("value", ["b", "/nowhere", "{b}", "{model}"])
def test_an_unregistered_adapter_is_refused_without_a_word_on_files(
        registered: openai.OpenAI, server_engine: Engine, adapters: dict[str, str],
        tiny_model_dir: Path, value: str) -> None:
    """An existing adapter directory, a missing path, a model directory: the same 400,
    which names neither the value nor what the server found there."""
    sent = value.format(b=adapters["b"], model=tiny_model_dir)
    loaded = server_engine.stats().adapters_loaded
    for create in (
            lambda: registered.chat.completions.create(
                model="tiny", max_tokens=4, messages=QUESTION,  # type: ignore[arg-type]
                extra_body={"adapter": sent}),
            lambda: registered.responses.create(
                model="tiny", max_output_tokens=4, input=QUESTION,  # type: ignore[arg-type]
                extra_body={"adapter": sent})):
        with pytest.raises(openai.BadRequestError) as raised:
            create()
        error = raised.value.body
        assert isinstance(error, dict) and error["param"] == "adapter"
        assert error["message"] == "adapter: not a registered adapter; registered: ['a']"
    assert server_engine.stats().adapters_loaded == loaded  # nothing was loaded


def test_a_model_suffix_names_registered_adapters_only(registered: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        registered.chat.completions.create(model="tiny:b", max_tokens=4,
                                           messages=QUESTION)  # type: ignore[arg-type]
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "model"
    assert "not a registered adapter; registered: ['a']" in error["message"]
    with pytest.raises(openai.BadRequestError, match="give one"):  # two different adapters
        registered.chat.completions.create(model="tiny:a", max_tokens=4, messages=QUESTION,  # type: ignore[arg-type]
                                           extra_body={"adapter": "b"})


def test_adapter_paths_load_when_allowed(server_engine: Engine,
                                         adapters: dict[str, str]) -> None:
    live = LiveServer(create_app({"tiny": server_engine}, settings=ServerSettings(
        adapters={"a": adapters["a"]}, allow_adapter_paths=True))).start()
    try:
        client = client_of(live)
        by_path = client.responses.create(model="tiny", max_output_tokens=8, input=QUESTION,  # type: ignore[arg-type]
                                          extra_body={"adapter": adapters["b"]})
        assert by_path.output_text == engine_text(server_engine, adapters["b"])
        by_name = client.chat.completions.create(model="tiny", max_tokens=8, messages=QUESTION,  # type: ignore[arg-type]
                                                 extra_body={"adapter": "a"})
        assert by_name.choices[0].message.content == engine_text(server_engine, adapters["a"])
    finally:
        live.stop()


def test_models_are_listed_once_each(server_engine: Engine, tiny_model_dir: Path,
                                     adapters: dict[str, str]) -> None:
    """An engine given alone is served under its path and its directory's name: one model,
    listed once, with each registered adapter once."""
    live = LiveServer(create_app(server_engine, settings=ServerSettings(
        adapters={"a": adapters["a"], "b": adapters["b"]}))).start()
    try:
        client = client_of(live)
        ids = [m.id for m in client.models.list()]
        name = str(tiny_model_dir)
        assert ids == [name, f"{name}:a", f"{name}:b"]
        alias = tiny_model_dir.name  # still served, by the same model
        answer = client.chat.completions.create(model=f"{alias}:a", max_tokens=8,
                                                messages=QUESTION)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == engine_text(server_engine, adapters["a"])
    finally:
        live.stop()
