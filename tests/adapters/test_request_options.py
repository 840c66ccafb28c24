"""Every door passes every request option: ``engine.REQUEST_OPTIONS`` is the one list.

For each option, a value other than its default is set at each door (a LangChain field and
a call option, a LlamaIndex field and a call option, a chat-completions body field, a
Responses body field, an Anthropic Messages body field, a legacy completions body field)
and the ``SamplingParams`` that reaches the engine carries it. A new option added to
``REQUEST_OPTIONS`` fails here until every door takes it. No model: the scripted engine
records what it was asked.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from starlette.testclient import TestClient

from engine import REQUEST_OPTIONS, SamplingParams
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from mlx_providers.server import ServerSettings, create_app
from tests.fake_engine import ScriptedEngine, scripted


def _adapter_dir() -> str:
    """An adapter directory whose files pass ``submit``'s check (nothing loads it here)."""
    root = Path(tempfile.mkdtemp(prefix="options-adapter-"))
    (root / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 2.0}}))
    (root / "adapters.safetensors").write_bytes(b"")
    return str(root)


# A value other than the default for each option (reasoning_budget, tool_call_limit:
# their default is None).
VALUES: dict[str, Any] = {
    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
    "repetition_penalty": 1.2, "seed": 11, "stop": ("END",), "logprobs": True,
    "top_logprobs": 3, "reasoning_budget": 4, "repeat_answered_calls": True,
    "tool_call_limit": 2, "adapter": _adapter_dir(),
}
# What a door names otherwise: a field of its own, or a body that asks for the option.
WIRE = {"responses": {"max_tokens": "max_output_tokens"},
        "anthropic": {"stop": "stop_sequences"}}
# The legacy completions' ``logprobs`` is an integer: 0 asks for the chosen tokens', N for
# N alternatives too (top_logprobs).
ASKED = {"responses": {"logprobs": {"include": ["message.output_text.logprobs"]}},
         "completions": {"logprobs": {"logprobs": 0},
                         "top_logprobs": {"logprobs": VALUES["top_logprobs"]}}}
# The server serves registered adapters: a body names one, the engine gets its directory.
SERVED_ADAPTER = "options"


def test_every_option_is_a_sampling_field_with_a_test_value() -> None:
    names = {f.name for f in fields(SamplingParams)}
    assert set(REQUEST_OPTIONS) <= names
    assert set(VALUES) == set(REQUEST_OPTIONS), "give the new option a value here"
    defaults = SamplingParams()
    for name, value in VALUES.items():
        assert getattr(defaults, name) != value, name


def _needs(name: str) -> dict[str, Any]:
    """The option with what it cannot go without (top_logprobs needs logprobs)."""
    return {"logprobs": True, name: VALUES[name]} if name == "top_logprobs" else {
        name: VALUES[name]}


def _sent(fake: ScriptedEngine) -> SamplingParams:
    assert fake.calls, "nothing reached the engine"
    return fake.calls[-1].params


def _wire(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", REQUEST_OPTIONS)
def test_langchain_passes_the_option_as_a_field_and_per_call(name: str) -> None:
    with scripted(f"lc-option-{name}") as fake:
        options = _needs(name)
        if name == "stop":
            ChatMLXBatch(model=f"lc-option-{name}", stop=list(VALUES["stop"])).invoke("hi")
            assert _sent(fake).stop == VALUES["stop"]
            ChatMLXBatch(model=f"lc-option-{name}").invoke("hi", stop=list(VALUES["stop"]))
        else:
            ChatMLXBatch(model=f"lc-option-{name}", **options).invoke("hi")
            assert getattr(_sent(fake), name) == VALUES[name]
            ChatMLXBatch(model=f"lc-option-{name}").invoke([HumanMessage("hi")], **options)
        assert getattr(_sent(fake), name) == VALUES[name]


@pytest.mark.parametrize("name", REQUEST_OPTIONS)
def test_llama_index_passes_the_option_as_a_field_and_per_call(name: str) -> None:
    with scripted(f"li-option-{name}") as fake:
        options = _needs(name)
        value = list(VALUES[name]) if name == "stop" else VALUES[name]
        MLXBatchLLM(model=f"li-option-{name}", **{**options, name: value}).complete("hi")
        assert getattr(_sent(fake), name) == VALUES[name]
        MLXBatchLLM(model=f"li-option-{name}").complete("hi", **{**options, name: value})
        assert getattr(_sent(fake), name) == VALUES[name]


def _body(door: str, name: str) -> dict[str, Any]:
    """The option (and what it needs) as ``door``'s request body says it."""
    body: dict[str, Any] = {}
    for key, value in _needs(name).items():
        if key in ASKED.get(door, {}):
            body.update(ASKED[door][key])
        elif key == "adapter":
            body["adapter"] = SERVED_ADAPTER
        else:
            body[WIRE.get(door, {}).get(key, key)] = _wire(value)
    return body


@pytest.mark.parametrize("door", ["chat", "responses", "anthropic", "completions"])
@pytest.mark.parametrize("name", REQUEST_OPTIONS)
def test_the_server_passes_the_option_in_the_body(door: str, name: str) -> None:
    fake = ScriptedEngine()
    options = _body(door, name)
    settings = ServerSettings(adapters={SERVED_ADAPTER: VALUES["adapter"]})
    with TestClient(create_app({"m": fake}, settings=settings)) as client:  # type: ignore[dict-item]
        if door == "chat":
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **options}
            reply = client.post("/v1/chat/completions", json=body)
        elif door == "anthropic":  # Anthropic's Messages API: max_tokens is required
            body = {"model": "m", "max_tokens": 16,
                    "messages": [{"role": "user", "content": "hi"}], **options}
            reply = client.post("/v1/messages", json=body)
        elif door == "completions":  # the legacy API: a raw prompt, no chat template
            reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                         **options})
        else:
            reply = client.post("/v1/responses", json={"model": "m", "input": "hi", **options})
    assert reply.status_code == 200, reply.text
    assert getattr(_sent(fake), name) == VALUES[name]


# Ollama's /api/chat: its names for the options it spells otherwise (in ``options``),
# logprobs as top-level fields, the adapter as the model's tag; every other option goes in
# ``options`` under its own name (this server's extension where Ollama has no name).
OLLAMA_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
OLLAMA_TOP_LEVEL = ("logprobs", "top_logprobs")


@pytest.mark.parametrize("name", REQUEST_OPTIONS)
def test_ollama_chat_passes_the_option(name: str) -> None:
    fake = ScriptedEngine()
    body: dict[str, Any] = {"model": "m", "stream": False, "options": {},
                            "messages": [{"role": "user", "content": "hi"}]}
    for key, value in _needs(name).items():
        if key == "adapter":
            body["model"] = f"m:{SERVED_ADAPTER}"
        elif key in OLLAMA_TOP_LEVEL:
            body[key] = value
        else:
            body["options"][OLLAMA_NAMES.get(key, key)] = _wire(value)
    settings = ServerSettings(adapters={SERVED_ADAPTER: VALUES["adapter"]})
    with TestClient(create_app({"m": fake}, settings=settings, embeddings={})) as client:  # type: ignore[dict-item]
        reply = client.post("/api/chat", json=body)
    assert reply.status_code == 200, reply.text
    assert getattr(_sent(fake), name) == VALUES[name]
