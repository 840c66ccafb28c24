"""Every family through every door: ChatMLXBatch (LangChain), MLXBatchLLM (LlamaIndex) and
the server (the openai SDK on loopback), on the family's real tokenizer and template.

Per family, one engine serves all three doors (``shared_engine`` makes it the process-wide
engine for the model's path, which the adapters look up; the server is given it). Each door
forces a ``get_weather`` call and gets it back parsed in its own types, with no call markup
in the content; LangChain sends a second turn with the ``ToolMessage``, whose result the real
template renders; the server streams the same forced call to the same arguments; a LangChain
``batch`` equals the same calls made alone. For the families that reason (the catalog's
``Expected.reasoning``), the tiny model is first fitted for seconds to reason then answer in
the family's own syntax; each door then puts the reasoning where it keeps reasoning
(``reasoning_content``, a ``ThinkingBlock``, the server's ``reasoning_content``) and only the
answer in content.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from engine import Engine, EngineConfig
from engine.registry import shared_engine
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.prompts import PromptRenderer
from mlx_providers import ChatMLXBatch, MLXBatchLLM
from mlx_providers.server import create_app
from testkit.families import FAMILIES
from testkit.families.fitting import Transcript, fit_to_transcripts
from tests.server.conftest import LiveServer

CITIES = ["Paris", "Oslo"]
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"]}}}
QUESTION = "What is the weather in Paris?"
RESULT = "22 degrees and sunny"
THINK_QUESTION = "What is 2 + 2?"
THINKING = {"enable_thinking": True}  # the switch every door passes to the template
# Room for one forced call in every family's syntax: DeepSeek-R1-Distill's markers are text
# in its Qwen vocabulary, so its call block alone is 66 tokens.
MAX_TOKENS = 96
# Markup no family's content may carry once its calls and reasoning are parsed.
MARKUP = ("<tool_call>", "[TOOL_CALLS]", "<|channel", "<|message|>", "<|tool_call",
          "to=functions", "<think>", "</think>", "[THINK]", "<\uff5ctool")

# What a fitted reasoning family writes after its prompt: a thought, then the answer.
THOUGHT, ANSWER = "Hmm.", "Four."


def _reasons(name: str) -> bool:
    return FAMILIES[name].expected.reasoning is not None


class WeatherArgs(BaseModel):
    """LlamaIndex's schema of ``get_weather``."""

    city: Literal["Paris", "Oslo"]


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return RESULT


def _renderer(eng: Engine) -> tuple[PromptRenderer, Callable[..., Any]]:
    """The engine's prompt rendering (as its thread does it) and its dialect's history."""
    tok = eng.tokenizer
    dialect = dialect_for(TokenizerFacts.of(tok))
    return (PromptRenderer(tok, eng.model_path, len(tok.vocab), dialect.tool_formats),
            dialect.history)


def rendered(eng: Engine, request: ChatRequest) -> tuple[str, bool]:
    """The prompt text the engine renders for a request, and whether it opens reasoning."""
    renderer, history = _renderer(eng)
    encoded = renderer.encode_request(request.messages, request.rendered_tools,
                                      dict(request.template_kwargs), history=history)
    return eng.tokenizer.decode(encoded.ids), encoded.opens_reasoning


def _fitted(source: Path, name: str, out: Path) -> Path:
    """A copy of the family's model fitted to reason then answer ``THINK_QUESTION``."""
    fitted = Path(shutil.copytree(source, out / name))
    expected = FAMILIES[name].expected
    assert expected.reasoning is not None
    eng = Engine(fitted, EngineConfig()).start()
    try:
        request = ChatRequest.from_openai([{"role": "user", "content": THINK_QUESTION}],
                                          chat_template_kwargs=THINKING)
        renderer, history = _renderer(eng)
        encoded = renderer.encode_request(request.messages, (), THINKING, history=history)
        completion = expected.reasoning.turn(THOUGHT, ANSWER, opened=encoded.opens_reasoning)
        ids = eng.tokenizer.encode(completion + expected.end_of_turn, add_special_tokens=False)
    finally:
        eng.close()
    fit_to_transcripts(fitted, [Transcript(encoded.ids, ids)])
    return fitted


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(name: str, family_model_dir: Callable[[str], Path],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family's model; fitted to reason first where the family reasons."""
    source = family_model_dir(name)
    if not _reasons(name):
        return source
    return _fitted(source, name, tmp_path_factory.mktemp("doors"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    """One engine for all doors: the process-wide engine of ``model_dir`` while in use."""
    eng = Engine(model_dir, EngineConfig(max_batch=4)).start()
    with shared_engine(str(model_dir), eng):
        yield eng
    eng.close()


@pytest.fixture(scope="module")
def chat(model_dir: Path, engine: Engine) -> ChatMLXBatch:
    llm = ChatMLXBatch(model=str(model_dir), max_tokens=MAX_TOKENS)
    assert llm.engine is engine
    return llm


@pytest.fixture(scope="module")
def index_llm(model_dir: Path, engine: Engine) -> MLXBatchLLM:
    llm = MLXBatchLLM(model_dir, max_tokens=MAX_TOKENS)
    assert llm.engine is engine
    return llm


@pytest.fixture(scope="module")
def client(name: str, engine: Engine) -> Iterator[openai.OpenAI]:
    server = LiveServer(create_app({name: engine})).start()
    with openai.OpenAI(base_url=server.base_url, api_key="none", timeout=120,
                       max_retries=0) as sdk:
        yield sdk
    server.stop()


def _no_markup(text: str | None) -> None:
    leaked = [m for m in MARKUP if m in (text or "")]
    assert not leaked, f"markup {leaked} left in content: {text!r}"


# ----- LangChain --------------------------------------------------------------------------

def test_langchain_forced_call_then_the_tool_result_turn(
        name: str, chat: ChatMLXBatch, engine: Engine) -> None:
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    question = HumanMessage(QUESTION)
    reply = bound.invoke([question])
    assert isinstance(reply, AIMessage)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"], reply
    assert reply.tool_calls[0]["args"]["city"] in CITIES
    assert not reply.invalid_tool_calls
    assert reply.content == "" and reply.response_metadata["finish_reason"] == "tool_calls"
    history = [question, reply, ToolMessage(RESULT, tool_call_id=reply.tool_calls[0]["id"])]
    # The engine renders the second turn (call id, past call, result) with the real template.
    text, _ = rendered(engine, bound.bound._request(history, None, bound.kwargs).chat)
    assert RESULT in text
    answer = bound.bound.bind_tools([WEATHER]).invoke(history, max_tokens=8)
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_langchain_batch_equals_each_call_alone(chat: ChatMLXBatch) -> None:
    prompts = ["Hi", QUESTION, "Name three colours.", "Write a haiku about the sea."]
    short = chat.bind(max_tokens=8)
    alone = [short.invoke(p) for p in prompts]
    together = short.batch(prompts)
    assert [(m.content, m.tool_calls) for m in together] == [
        (m.content, m.tool_calls) for m in alone]


# ----- LlamaIndex -------------------------------------------------------------------------

def test_llama_index_forced_call_is_a_tool_selection(index_llm: MLXBatchLLM) -> None:
    tool = FunctionTool.from_defaults(fn=get_weather, fn_schema=WeatherArgs)
    response = index_llm.chat_with_tools([tool], user_msg=QUESTION, tool_required=True)
    selections = index_llm.get_tool_calls_from_response(response)
    assert [s.tool_name for s in selections] == ["get_weather"]
    assert selections[0].tool_kwargs["city"] in CITIES
    _no_markup(response.message.content)
    assert not (response.message.content or "").strip()


# ----- the server -------------------------------------------------------------------------

def _forced(client: openai.OpenAI, name: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS,
        temperature=0, **kwargs)


def test_server_forced_call_streams_the_same_arguments(name: str,
                                                       client: openai.OpenAI) -> None:
    whole = _forced(client, name).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls or []] == ["get_weather"]
    arguments = json.loads(whole.message.tool_calls[0].function.arguments)
    assert arguments["city"] in CITIES
    assert not (whole.message.content or "")
    names: dict[int, str] = {}
    streamed: dict[int, str] = {}
    content, finish = "", None
    for chunk in _forced(client, name, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = call.function.name
            streamed[call.index] = (streamed.get(call.index, "")
                                    + ((call.function and call.function.arguments) or ""))
    assert finish == "tool_calls" and content == ""
    assert names == {0: "get_weather"}
    assert json.loads(streamed[0]) == arguments


# ----- reasoning at every door ------------------------------------------------------------

def test_reasoning_is_split_at_every_door(name: str, chat: ChatMLXBatch,
                                          index_llm: MLXBatchLLM,
                                          client: openai.OpenAI) -> None:
    if not _reasons(name):
        pytest.skip(f"{name} has no reasoning syntax")
    reply = chat.invoke(THINK_QUESTION, reasoning=True)
    assert reply.additional_kwargs["reasoning_content"].strip() == THOUGHT
    assert reply.content == ANSWER

    response = index_llm.chat([ChatMessage(role="user", content=THINK_QUESTION)],
                              chat_template_kwargs=THINKING)
    thinking = [b.content for b in response.message.blocks if isinstance(b, ThinkingBlock)]
    assert [(t or "").strip() for t in thinking] == [THOUGHT]
    assert response.message.content == ANSWER

    served = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": THINK_QUESTION}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"chat_template_kwargs": THINKING})
    message = served.choices[0].message
    assert (message.model_extra or {})["reasoning_content"].strip() == THOUGHT
    assert message.content == ANSWER
