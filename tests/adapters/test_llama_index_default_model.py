"""MLXBatchLLM on the real default model (SmolLM2-135M-Instruct): every kind of call at once,
so they share one batch and the test costs about one short generation."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Document, SimpleKeywordTableIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel

from mlx_providers import MLXBatchLLM

# The real default model decoding at length: make test-real (CI) runs it.
pytestmark = [pytest.mark.slow, pytest.mark.real]

FRANCE = [ChatMessage(role=MessageRole.USER,
                      content="What is the capital of France? Answer in one word.")]


class Capital(BaseModel):
    city: str
    country: str


DOCS = ["The Zorblax fruit is bright purple and grows only on Mount Tervo.",
        "Quartz clocks keep time with a vibrating crystal."]


async def test_default_model_chat_stream_structured_and_rag_in_one_batch() -> None:
    llm = MLXBatchLLM(max_tokens=10)
    assert llm.metadata.context_window == 8192
    index = SimpleKeywordTableIndex.from_documents([Document(text=t) for t in DOCS], llm=llm)
    query_engine = index.as_query_engine(llm=llm)

    async def stream() -> list[str]:
        return [c.delta or "" async for c in await llm.astream_chat(FRANCE)]

    sync, chunks, capital, answer = await asyncio.gather(
        asyncio.to_thread(llm.chat, FRANCE),
        stream(),
        llm.astructured_predict(Capital, PromptTemplate(
            "Name the capital of France and its country as JSON."),
            llm_kwargs={"max_tokens": 24}),
        query_engine.aquery("What color is the Zorblax fruit?"),
    )
    assert "Paris" in (sync.message.content or "")
    assert "".join(chunks) == sync.message.content and len(chunks) > 1
    assert isinstance(capital, Capital) and capital.city == "Paris"
    assert [n.node.get_content() for n in answer.source_nodes] == [DOCS[0]]
    assert "purple" in str(answer).lower()
    assert llm.engine.stats().peak_running >= 4
