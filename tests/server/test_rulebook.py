"""One rulebook at every door: the same requests through ``Engine.submit``,
``ChatMLXBatch.invoke``, ``MLXBatchLLM.chat`` and the server's ``/v1/chat/completions`` and
``/v1/responses`` (over real loopback sockets) are accepted alike, or refused naming the
same field (a 4xx at the server).

Each case is OpenAI-shaped; each door gets it in its own types (LangChain takes the dicts,
LlamaIndex ``ChatMessage``s, Responses input items), the way a caller of that door would
write it. The tiny model and ``max_tokens=4`` keep every accepted request to a few steps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock, ToolCallBlock
from pydantic import ValidationError

from engine import ChatRequest, Engine, SamplingParams
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from mlx_providers.server import create_app
from tests.conftest import own_copy
from tests.server.conftest import LiveServer

OK = "accepted"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def call(arguments: Any, call_id: str = "c1") -> dict[str, Any]:
    """An assistant turn that called get_weather."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]}


@dataclass(frozen=True)
class Case:
    """One request, and the field every door must name (None: every door accepts it).

    ``responses_field`` is the same field as the Responses API spells it, where it does.
    """

    name: str
    messages: list[dict[str, Any]]
    field: str | None = None
    responses_field: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


CASES = [
    # ----- accepted alike -----
    Case("system and user", [{"role": "system", "content": "Be brief."}, USER]),
    Case("developer is a system message", [{"role": "developer", "content": "Be brief."}, USER]),
    Case("text parts are joined", [{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]),
    Case("a tool round trip", [USER, call('{"city": "Paris"}'),
                               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
         options={"tools": [WEATHER], "tool_choice": "auto"}),
    Case("tool_choice none", [USER], options={"tools": [WEATHER], "tool_choice": "none"}),
    Case("a namespaced (MCP) tool name", [USER], options={"tools": [
        {"type": "function", "function": {"name": "weather:current"}}]}),
    # ----- refused alike, naming the field -----
    Case("an odd role spelling", [{"role": "human", "content": "hi"}],
         "messages[0].role", "input[0].role"),
    Case("a role in capitals", [{"role": "USER", "content": "hi"}],
         "messages[0].role", "input[0].role"),
    Case("a remote image URL (never fetched)", [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}],
         "messages[0].content[1]", "input[0].content[1]"),
    Case("tool-call arguments that are not JSON", [USER, call("{oops")],
         "messages[1].tool_calls[0].function.arguments", "input[1].arguments"),
    Case("tool-call arguments that are not an object", [USER, call("[1, 2]")],
         "messages[1].tool_calls[0].function.arguments", "input[1].arguments"),
    Case("a tool message without tool_call_id",
         [USER, call('{"city": "Paris"}'), {"role": "tool", "content": "sunny"}],
         "messages[2].tool_call_id", "input[2].call_id"),
    Case("a tool whose parameters are not an object schema", [USER],
         "tools[0].function.parameters.type", "tools[0].parameters.type",
         {"tools": [{"type": "function", "function": {
             "name": "f", "parameters": {"type": "array"}}}]}),
    Case("a tool name a call cannot be written with", [USER],
         "tools[0].function.name", "tools[0].name",
         {"tools": [{"type": "function", "function": {"name": "get weather!"}}]}),
    Case("tool_choice naming an unknown tool", [USER], "tool_choice", "tool_choice",
         {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    Case("a negative max_tokens", [USER], "max_tokens", "max_output_tokens",
         {"max_tokens": -1}),
    Case("a negative temperature", [USER], "temperature", "temperature",
         {"temperature": -1.0}),
]


# ----- the doors: each returns OK or the field it refused -----------------------------------


def refused_field(exc: BaseException) -> str:
    """The field an in-process door named (the rulebook's ``InvalidRequestError.field``)."""
    name = getattr(exc, "field", None)
    assert isinstance(name, str), f"{type(exc).__name__} names no field: {exc}"
    assert name in str(exc), f"the message does not name {name}: {exc}"
    return name


def sampling(case: Case) -> dict[str, Any]:
    return {"max_tokens": case.options.get("max_tokens", 4),
            "temperature": case.options.get("temperature", 0.0)}


def tool_options(case: Case) -> dict[str, Any]:
    return {k: case.options[k] for k in ("tools", "tool_choice") if k in case.options}


def engine_door(eng: Engine, case: Case) -> str:
    try:
        params = SamplingParams(**sampling(case))
        request = ChatRequest.from_openai(case.messages, params, **tool_options(case))
        eng.submit(request).result(timeout=60)
    except (ValueError, TypeError) as exc:
        return refused_field(exc)
    return OK


def langchain_door(chat: ChatMLXBatch, case: Case) -> str:
    try:
        chat.invoke(case.messages, **sampling(case), **tool_options(case))
    except (ValueError, TypeError) as exc:
        return refused_field(exc)
    return OK


def llama_index_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """The case as a LlamaIndex caller writes it: ChatMessages with blocks."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        blocks: list[Any] = []
        if isinstance(content, str):
            blocks.append(TextBlock(text=content))
        for part in content if isinstance(content, list) else ():
            if part["type"] == "text":
                blocks.append(TextBlock(text=part["text"]))
            else:
                blocks.append(ImageBlock(url=part["image_url"]["url"]))
        blocks += [ToolCallBlock(tool_call_id=c["id"], tool_name=c["function"]["name"],
                                 tool_kwargs=c["function"]["arguments"])
                   for c in m.get("tool_calls", ())]
        extra = {"tool_call_id": m["tool_call_id"]} if "tool_call_id" in m else {}
        try:
            out.append(ChatMessage(role=m["role"], blocks=blocks, additional_kwargs=extra))
        except ValidationError as exc:  # LlamaIndex's own type refuses the role
            (error,) = exc.errors()
            raise LookupError(f"messages[{i}].{error['loc'][0]}") from exc
    return out


def llama_index_door(llm: MLXBatchLLM, case: Case) -> str:
    try:
        llm.chat(llama_index_messages(case.messages), **sampling(case), **tool_options(case))
    except LookupError as exc:
        return str(exc)
    except (ValueError, TypeError) as exc:
        return refused_field(exc)
    return OK


def http_outcome(response: httpx.Response) -> str:
    if response.status_code == 200:
        return OK
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] and error["message"], error
    return str(error["param"])


def chat_completions_door(server: LiveServer, case: Case) -> str:
    body = {"model": "tiny", "messages": case.messages, **sampling(case), **tool_options(case)}
    return http_outcome(httpx.post(f"{server.base_url}/chat/completions", json=body,
                                   timeout=60))


def responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The case as Responses input items: messages, function calls and their outputs."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "output": m["content"],
                          **({"call_id": m["tool_call_id"]} if "tool_call_id" in m else {})})
        elif m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in m["tool_calls"]]
        elif isinstance(m["content"], list):
            parts = [{"type": "input_text", "text": p["text"]} if p["type"] == "text"
                     else {"type": "input_image", "image_url": p["image_url"]["url"]}
                     for p in m["content"]]
            items.append({"type": "message", "role": m["role"], "content": parts})
        else:
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
    return items


def responses_door(server: LiveServer, case: Case) -> str:
    body: dict[str, Any] = {"model": "tiny", "input": responses_input(case.messages),
                            "max_output_tokens": sampling(case)["max_tokens"],
                            "temperature": sampling(case)["temperature"], "store": False}
    tools = case.options.get("tools")
    if tools:  # Responses tools are flat: {"type", "name", "parameters"}
        body["tools"] = [{"type": "function", **t["function"]} for t in tools]
    choice = case.options.get("tool_choice")
    if isinstance(choice, dict):
        body["tool_choice"] = {"type": "function", "name": choice["function"]["name"]}
    elif choice is not None:
        body["tool_choice"] = choice
    return http_outcome(httpx.post(f"{server.base_url}/responses", json=body, timeout=60))


# ----- fixtures: one engine behind all five doors ------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hard-linked copy of the tiny model: a path of its own, so an engine of its own."""
    return own_copy(tiny_model_dir, tmp_path_factory.mktemp("rulebook") / "tiny")


@pytest.fixture(scope="module")
def doors(model_dir: Path) -> Iterator[dict[str, Callable[[Case], str]]]:
    """The five doors, all on the one engine the adapters share for this model."""
    llm = MLXBatchLLM(model_dir, engine_config={"max_batch": 8, "prefill_chunk": 64})
    chat = ChatMLXBatch(model=str(model_dir))
    eng = llm.engine
    assert chat.engine is eng
    server = LiveServer(create_app({"tiny": eng})).start()
    yield {"Engine.submit": lambda case: engine_door(eng, case),
           "ChatMLXBatch.invoke": lambda case: langchain_door(chat, case),
           "MLXBatchLLM.chat": lambda case: llama_index_door(llm, case),
           "/v1/chat/completions": lambda case: chat_completions_door(server, case),
           "/v1/responses": lambda case: responses_door(server, case)}
    server.stop()
    eng.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_door_gives_the_same_answer(doors: dict[str, Callable[[Case], str]],
                                          case: Case) -> None:
    outcomes = {name: door(case) for name, door in doors.items()}
    expected = {name: OK if case.field is None
                else case.responses_field if name == "/v1/responses" else case.field
                for name in doors}
    assert outcomes == expected, json.dumps(outcomes, indent=1)
