"""Real framework clients on the server: LangChain's ChatOpenAI, LlamaIndex's OpenAILike."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from engine import Engine
from tests.server.conftest import LiveServer


@tool
def pick(colour: Literal["red", "blue"]) -> str:
    """Pick a colour."""
    return f"picked {colour}"


def pick_colour(colour: Literal["red", "blue"]) -> str:
    """Pick a colour."""
    return f"picked {colour}"


# LlamaIndex reads annotations as objects, and this module's are strings (__future__).
pick_colour.__annotations__ = {"colour": Literal["red", "blue"], "return": str}


def chat_openai(server: LiveServer, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(model="tiny", base_url=server.base_url, api_key="unused",  # type: ignore[arg-type]
                      max_retries=0, timeout=60, **kw)


def test_chat_openai_on_chat_completions(live_server: LiveServer) -> None:
    llm = chat_openai(live_server, max_tokens=6, stream_usage=True)
    message = llm.invoke("Hello")
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata and message.usage_metadata["output_tokens"] == 6
    chunks = list(llm.stream("Hello"))
    assert "".join(str(c.content) for c in chunks) == message.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == 6


def test_chat_openai_forced_tool_call_on_chat_completions(live_server: LiveServer) -> None:
    llm = chat_openai(live_server, max_tokens=100).bind_tools([pick], tool_choice="pick")
    message = llm.invoke("Choose.")
    assert isinstance(message, AIMessage)
    assert [c["name"] for c in message.tool_calls] and all(
        c["name"] == "pick" and c["args"]["colour"] in ("red", "blue")
        for c in message.tool_calls)


def test_chat_openai_responses_api_two_turns_with_previous_response_id(
        live_server: LiveServer) -> None:
    llm = chat_openai(live_server, max_tokens=8, use_responses_api=True,
                      use_previous_response_id=True)
    history: list[Any] = [HumanMessage("My name is Ada.")]
    first = llm.invoke(history)
    assert isinstance(first, AIMessage) and first.id and first.id.startswith("resp_")
    assert first.text
    history += [first, HumanMessage("What is my name?")]
    second = llm.invoke(history)
    assert isinstance(second, AIMessage) and second.text and second.id
    stored = live_server.app.state.ctx.store.get(second.id)  # type: ignore[attr-defined]
    assert stored.response["previous_response_id"] == first.id
    assert len(stored.input_items) == 3  # the first question and answer came from the store
    assert second.usage_metadata is not None and first.usage_metadata is not None
    # Only the new message went over the wire; the server replayed the rest from its store
    # (and the engine reused the first turn's KV).
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
    cache_read = second.usage_metadata.get("input_token_details", {}).get("cache_read", 0)
    assert cache_read >= first.usage_metadata["input_tokens"]


def test_chat_openai_responses_api_tool_call_round_trip(live_server: LiveServer) -> None:
    llm = chat_openai(live_server, max_tokens=60, use_responses_api=True,
                      use_previous_response_id=True)
    with_tools = llm.bind_tools([pick], tool_choice="required")
    history: list[Any] = [HumanMessage("Choose a colour.")]
    first = with_tools.invoke(history)
    assert isinstance(first, AIMessage) and first.tool_calls
    call = first.tool_calls[0]
    assert call["name"] == "pick" and call["args"]["colour"] in ("red", "blue")
    history += [first, ToolMessage(pick.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([pick]).invoke(history)
    assert isinstance(answer, AIMessage) and answer.text is not None and answer.id
    stored = live_server.app.state.ctx.store.get(answer.id)  # type: ignore[attr-defined]
    assert stored.response["previous_response_id"] == first.id
    assert [i.get("type") for i in stored.input_items[-2:]] == [
        "function_call", "function_call_output"]
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] > 0


def test_chat_openai_responses_api_stream(live_server: LiveServer) -> None:
    llm = chat_openai(live_server, max_tokens=8, use_responses_api=True)
    chunks = list(llm.stream("Hello"))
    text = "".join(c.text for c in chunks)
    assert text and text == llm.invoke("Hello").text


async def test_llama_index_openai_like_drives_a_function_agent(
        live_server: LiveServer, server_engine: Engine) -> None:
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model="tiny", api_base=live_server.base_url, api_key="unused",
                     is_chat_model=True, is_function_calling_model=True, max_tokens=40,
                     context_window=2048, max_retries=0, timeout=60)
    colour_tool = FunctionTool.from_defaults(pick_colour)
    # The function-calling path: a forced call comes back as a parsed tool selection.
    response = await llm.achat_with_tools([colour_tool], chat_history=[
        ChatMessage(role="user", content="Pick a colour.")], tool_required=True)
    [selection] = llm.get_tool_calls_from_response(response)[:1]
    assert selection.tool_name == "pick_colour"
    assert selection.tool_kwargs["colour"] in ("red", "blue")
    # And a whole agent run over HTTP (the random-weight model answers in text).
    agent = FunctionAgent(tools=[colour_tool], llm=llm)
    before = server_engine.stats().completed
    result = await agent.run("Pick a colour for me.")
    assert str(result)
    assert server_engine.stats().completed > before


async def test_http_clients_and_in_process_chat_models_share_one_batch(
        tiny_model_dir: Any, tmp_path: Any) -> None:
    """The app on ``get_engine``'s engine: ChatMLXBatch in-process and HTTP clients are rows
    of the same batch."""
    import asyncio
    import shutil

    import openai

    from engine import get_engine
    from mlx_providers import ChatMLXBatch
    from mlx_providers.server import create_app

    model = str(shutil.copytree(tiny_model_dir, tmp_path / "tiny"))
    eng = get_engine(model, max_batch=8)
    server = LiveServer(create_app(eng)).start()
    try:
        assert server.app.state.ctx.models.get("tiny").engine is eng  # type: ignore[attr-defined]
        chat = ChatMLXBatch(model=model, max_tokens=300)
        assert chat.engine is eng
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        question = [{"role": "user", "content": "hi"}]
        await asyncio.gather(
            chat.ainvoke("hi"), chat.ainvoke("hello"),
            client.chat.completions.create(model="tiny", messages=question, max_tokens=300),  # type: ignore[arg-type]
            client.chat.completions.create(model=model, messages=question, max_tokens=300))  # type: ignore[arg-type]
        assert eng.stats().completed == 4 and eng.stats().peak_running >= 3
    finally:
        server.stop()
        eng.close()


def test_chat_openai_responses_api_resends_the_history_without_a_store(
        live_server: LiveServer) -> None:
    """Without previous_response_id ChatOpenAI sends earlier answers back as output items."""
    llm = chat_openai(live_server, max_tokens=8, use_responses_api=True)
    first = llm.invoke([HumanMessage("My name is Ada.")])
    second = llm.invoke([HumanMessage("My name is Ada."), first,
                         HumanMessage("What is my name?")])
    assert isinstance(second, AIMessage) and second.text and second.id
    stored = live_server.app.state.ctx.store.get(second.id)  # type: ignore[attr-defined]
    assert stored.response["previous_response_id"] is None
    assert len(stored.input_items) == 3
    replayed = stored.input_items[1]
    text = replayed["content"] if isinstance(replayed["content"], str) else "".join(
        part.get("text", "") for part in replayed["content"])
    assert text == first.text  # the earlier answer reached the prompt
    assert second.usage_metadata is not None and first.usage_metadata is not None
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
