"""Standard tests the random-weight model cannot pass, on SmolLM2-135M-Instruct, batched.

The tiny model's run of LangChain's suite (``tests/adapters/test_langchain_standard.py``)
marks these ``xfail``; here their sync and async bodies run at the same time on the
default model, so their requests share the engine's batch. Part of ``make test-real``
(default model), beside the whole suite on that model.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from mlx_providers import ChatMLXBatch

pytestmark = pytest.mark.real


class TestChatMLXBatchSmolLM2:
    """Standard tests the random-weight model cannot pass, on SmolLM2-135M-Instruct.

    Only these: on this CPU SmolLM2 decodes a few tokens per second. The sync and async
    tests run at the same time, so their requests share the engine's batch.
    """

    async def test_tool_calling_sync_and_async(self) -> None:
        # A user's settings: the engine ends a forced-call row that repeats its call, so the
        # answer holds exactly the one call without a tight max_tokens.
        smol = ChatMLXBatch(max_tokens=256, temperature=0)
        suite = _Suite()
        await asyncio.gather(asyncio.to_thread(suite.test_tool_calling, smol),
                             suite.test_tool_calling_async(smol))

    async def test_structured_output_pydantic_sync_and_async(self) -> None:
        # Grammar-constrained JSON (the default json_schema method), greedy, no penalty:
        # SmolLM2-135M loops on "a cat is a cat, ..." inside "setup" unless the engine's JSON
        # string loop guard (json_string_ngram, on by default) refuses the repeat.
        smol = ChatMLXBatch(max_tokens=256, temperature=0)
        suite = _Suite()
        await asyncio.gather(asyncio.to_thread(suite.test_structured_output, smol, "pydantic"),
                             suite.test_structured_output_async(smol, "pydantic"))


class _Suite(ChatModelIntegrationTests):
    """The standard suite's settings, to call its test bodies with another model."""

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatMLXBatch

    @property
    def supports_json_mode(self) -> bool:
        return True
