"""Ollama's API door through the real ``ollama`` client over loopback.

The tiny model has random weights: these tests check structure and that the door asks
the engine what the engine would be asked directly (a greedy answer through ``/api/chat``
or ``/api/generate`` equals the engine's own, token for token), never meaning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import ollama
import pytest

from engine import (
    ChatRequest,
    Completion,
    Engine,
    Request,
    SamplingParams,
    TextRequest,
    token_texts,
)
from mlx_providers.server import create_app
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(120)
EMBEDDING = "all-MiniLM-L6-v2"
HELLO = [{"role": "user", "content": "Hello there"}]
# In the key order the ``ollama`` client sends (its Tool model's): the template renders
# the tools as JSON, so the engine's own request must spell them the same.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(server_engine: Engine, embedding_model_dir: Path) -> Iterator[LiveServer]:
    """The tiny chat model as ``tiny`` and the default embedding model beside it."""
    live = LiveServer(create_app({"tiny": server_engine},
                                 embeddings={EMBEDDING: None})).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def engine_answer(engine: Engine, request: Request) -> Completion:
    """What the engine answers the request itself, with no door in between."""
    return engine.submit(request).result(timeout=60)


def chat_request(messages: list[dict[str, Any]], max_tokens: int, **chat: Any) -> ChatRequest:
    return ChatRequest.from_openai(messages, SamplingParams(max_tokens=max_tokens), **chat)


def test_chat_is_the_engine_s_own_greedy_answer(client: ollama.Client,
                                                server_engine: Engine) -> None:
    reply = client.chat(model="tiny", messages=HELLO, options={"num_predict": 12})
    want = engine_answer(server_engine, chat_request(HELLO, 12))
    assert reply.message.role == "assistant" and reply.message.content == want.content
    assert reply.done and reply.done_reason == "length"  # 12 tokens, cut by num_predict
    assert reply.model == "tiny"
    assert reply.prompt_eval_count == want.usage.prompt_tokens
    assert reply.eval_count == want.usage.completion_tokens == 12
    for figure in ("total_duration", "load_duration", "prompt_eval_duration",
                   "eval_duration"):
        assert isinstance(reply[figure], int) and reply[figure] >= 0, figure
    assert reply.eval_duration and reply.eval_duration > 0  # clients divide by it


def test_a_stream_is_ndjson_chunks_ending_with_done(client: ollama.Client,
                                                    server_engine: Engine) -> None:
    chunks = list(client.chat(model="tiny:latest", messages=HELLO, stream=True,
                              options={"num_predict": 10}))
    *parts, last = chunks
    assert parts and not any(c.done for c in parts) and last.done
    assert all(c.model == "tiny:latest" for c in chunks)  # the name as the client sent it
    assert last.done_reason == "length" and last.eval_count == 10
    assert last.message.content == "" and last.total_duration
    whole = client.chat(model="tiny", messages=HELLO, options={"num_predict": 10})
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content


def test_the_tokens_are_the_engine_s_own(client: ollama.Client, server_engine: Engine) -> None:
    """Logprobs name each generated token: the door's are the engine's, one by one."""
    reply = client.chat(model="tiny", messages=HELLO, logprobs=True, top_logprobs=2,
                        options={"num_predict": 8})
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2)
    want = engine_answer(server_engine, ChatRequest.from_openai(HELLO, params))
    text = token_texts(server_engine.tokenizer)
    assert reply.logprobs is not None
    assert [p.token for p in reply.logprobs] == [text(t) for t in want.token_ids]
    assert want.logprobs is not None
    assert [p.logprob for p in reply.logprobs] == pytest.approx(
        [lp.logprob for lp in want.logprobs])
    assert all(len(p.top_logprobs or ()) == 2 for p in reply.logprobs)
    streamed = [p.token for c in client.chat(model="tiny", messages=HELLO, logprobs=True,
                                              stream=True, options={"num_predict": 8})
                for p in c.logprobs or ()]
    assert streamed == [p.token for p in reply.logprobs]


def test_generate_renders_the_prompt_with_the_template(client: ollama.Client,
                                                       server_engine: Engine) -> None:
    reply = client.generate(model="tiny", prompt="Tell me a story", system="Be brief.",
                            options={"num_predict": 9})
    want = engine_answer(server_engine, chat_request(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Tell me a story"}], 9))
    assert reply.response == want.content and reply.eval_count == 9
    assert reply.prompt_eval_count == want.usage.prompt_tokens
    streamed = list(client.generate(model="tiny", prompt="Tell me a story", system="Be brief.",
                                    stream=True, options={"num_predict": 9}))
    assert streamed[-1].done and not any(c.done for c in streamed[:-1])
    assert "".join(c.response or "" for c in streamed) == reply.response


def test_raw_generate_continues_the_prompt_as_it_is(client: ollama.Client,
                                                    server_engine: Engine) -> None:
    reply = client.generate(model="tiny", prompt="def add(a, b):", raw=True,
                            options={"num_predict": 7})
    want = engine_answer(server_engine,
                         TextRequest("def add(a, b):", SamplingParams(max_tokens=7)))
    assert reply.response == want.content
    assert reply.prompt_eval_count == want.usage.prompt_tokens  # no template around it


def test_options_reach_the_engine(client: ollama.Client, server_engine: Engine) -> None:
    """A stop string and a seeded sample: the engine's answer to the same settings."""
    options = {"num_predict": 16, "temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": 7}
    reply = client.chat(model="tiny", messages=HELLO, options=options)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, top_k=20, seed=7)
    assert reply.message.content == engine_answer(
        server_engine, ChatRequest.from_openai(HELLO, params)).content
    first = client.chat(model="tiny", messages=HELLO, options={"num_predict": 16})
    text = first.message.content or ""
    stop = next(w for w in text.split()[1:] if w.isascii() and w.isalpha())
    cut = client.chat(model="tiny", messages=HELLO, options={"num_predict": 16,
                                                              "stop": [stop]})
    assert cut.done_reason == "stop" and cut.message.content == text[:text.index(stop)]


def test_a_json_schema_format_gives_json_that_validates(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "colour": {"enum": ["red", "blue"]}},
        "required": ["ok", "colour"], "additionalProperties": False}
    reply = client.chat(model="tiny", messages=HELLO, format=schema,
                        options={"num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content or ""), schema)
    streamed = "".join(c.message.content or "" for c in client.chat(
        model="tiny", messages=HELLO, format=schema, stream=True, options={"num_predict": 60}))
    assert streamed == reply.message.content
    generated = client.generate(model="tiny", prompt="Answer in JSON", format=schema,
                                options={"num_predict": 60})
    jsonschema.validate(json.loads(generated.response or ""), schema)


def test_tools_reach_the_prompt(client: ollama.Client, server_engine: Engine) -> None:
    """The random model calls nothing by itself: the tools are in the prompt the engine
    renders, as they would be asked directly (calls out: test_ollama_tool_calls.py)."""
    reply = client.chat(model="tiny", messages=HELLO, tools=[WEATHER],
                        options={"num_predict": 6})
    want = engine_answer(server_engine, chat_request(HELLO, 6, tools=[WEATHER]))
    assert reply.message.content == want.content
    assert reply.prompt_eval_count == want.usage.prompt_tokens
    plain = client.chat(model="tiny", messages=HELLO, options={"num_predict": 1})
    assert reply.prompt_eval_count is not None and plain.prompt_eval_count is not None
    assert reply.prompt_eval_count > plain.prompt_eval_count + 20


def test_a_tool_round_trip_in_ollama_s_shapes(client: ollama.Client,
                                              server_engine: Engine) -> None:
    """Ollama's history (calls without ids, arguments as objects, a result by
    ``tool_name``) reaches the template as the same conversation in OpenAI's shapes."""
    history: list[dict[str, Any]] = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    reply = client.chat(model="tiny", messages=history, tools=[WEATHER],
                        options={"num_predict": 6})
    openai_history = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1_0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1_0",
         "name": "get_weather"}]
    want = engine_answer(server_engine, chat_request(openai_history, 6, tools=[WEATHER]))
    assert reply.message.content == want.content
    assert reply.prompt_eval_count == want.usage.prompt_tokens


def test_embed_is_the_engine_s_vectors(client: ollama.Client, server_engine: Engine,
                                       embedding_model_dir: Path) -> None:
    texts = ["The cat sat.", "A dog ran."]
    reply = client.embed(model=EMBEDDING, input=texts)
    want = server_engine.embed(texts, embedding_model_dir).result(timeout=60).vectors
    np.testing.assert_allclose(np.array(reply.embeddings, np.float32), want, rtol=1e-6)
    assert reply.prompt_eval_count and reply.prompt_eval_count > 4
    one = client.embed(model=f"{EMBEDDING}:latest", input="The cat sat.")
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 384
    with pytest.raises(ollama.ResponseError) as raised:
        client.embed(model="tiny", input="hi")
    assert raised.value.status_code == 404 and "chat model" in raised.value.error


def test_the_listings(client: ollama.Client, server_engine: Engine) -> None:
    models = {m.model: m for m in client.list().models}
    assert set(models) == {"tiny:latest", f"{EMBEDDING}:latest"}
    tiny = models["tiny:latest"]
    assert tiny.details is not None and tiny.details.family == "qwen2"
    assert tiny.details.format == "safetensors" and tiny.details.parameter_size
    assert tiny.size and tiny.size > 0 and tiny.digest and len(tiny.digest) == 64
    assert tiny.modified_at is not None
    shown = client.show("tiny")
    assert shown.modelinfo is not None
    assert shown.modelinfo["qwen2.context_length"] == server_engine.context_limit == 2048
    assert shown.modelinfo["general.architecture"] == "qwen2"
    assert isinstance(shown.template, str) and "im_start" in shown.template
    assert isinstance(shown.parameters, str) and "num_predict 512" in shown.parameters
    assert shown.capabilities == ["completion", "tools"]  # no thinking, images or FIM
    assert client.show(EMBEDDING).capabilities == ["embedding"]
    running = {m.model: m for m in client.ps().models}
    assert running["tiny:latest"].context_length == 2048
    assert f"{EMBEDDING}:latest" in running
    assert client.show("tiny:latest").modelinfo == shown.modelinfo


def test_errors_are_ollama_s_shape(client: ollama.Client, server: LiveServer) -> None:
    def refused(call: Any) -> ollama.ResponseError:
        with pytest.raises(ollama.ResponseError) as raised:
            call()
        return raised.value

    unknown = refused(lambda: client.chat(model="nope", messages=HELLO))
    assert unknown.status_code == 404 and "'nope'" in unknown.error
    bad = refused(lambda: client.chat(model="tiny", messages=HELLO, options={"top_p": 2}))
    assert bad.status_code == 400 and bad.error.startswith("options.top_p")
    long = [{"role": "user", "content": "word " * 3000}]
    overflow = refused(lambda: client.chat(model="tiny", messages=long))
    assert overflow.status_code == 400 and "context" in overflow.error
    streamed = refused(lambda: list(client.chat(model="tiny", messages=long, stream=True)))
    assert streamed.status_code == 400  # refused before the stream starts
    fim = refused(lambda: client.generate(model="tiny", prompt="def f(", suffix="return 1"))
    assert fim.status_code == 400 and "does not support insert" in fim.error
    template = refused(lambda: client.generate(model="tiny", prompt="x", template="{{ .P }}"))
    assert template.status_code == 400 and template.error.startswith("template")
    image = refused(lambda: client.chat(model="tiny", messages=[
        {"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}]))
    assert image.status_code == 400 and "messages[0].images[0]" in image.error
    bad_call = refused(lambda: client.chat(model="tiny", messages=[
        *HELLO, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "", "arguments": {}}}]}]))
    assert bad_call.status_code == 400 and "messages[1].tool_calls[0]" in bad_call.error
    import httpx

    body = httpx.post(server.url + "/api/chat", content=b"{not json", timeout=10)
    assert body.status_code == 400 and set(body.json()) == {"error"}
    assert client.chat(model="tiny", messages=HELLO, options={"num_predict": 2}).done


def test_the_version_and_the_root(server: LiveServer, client: ollama.Client) -> None:
    import httpx

    assert httpx.get(server.url + "/", timeout=10).text == "Ollama is running"
    version = httpx.get(server.url + "/api/version", timeout=10).json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 12]
