"""LangChain's whole standard integration suite on the default model, SmolLM2-135M-Instruct.

Run with ``make test-real`` (``pytest -m real``); the default test run skips it. The suite
is unchanged (``langchain-tests``), with the settings a new user would pick: greedy,
``max_tokens=256``, JSON mode declared. A test the model itself cannot do is marked
``xfail`` with what was measured; everything else must pass.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from mlx_providers import ChatMLXBatch
from tests.adapters.test_langchain_standard import CacheReadUsage

pytestmark = pytest.mark.real

# Standard tests SmolLM2-135M cannot pass, by test name: what it does instead (measured).
_NO_AUTO_CALL = ("with tool_choice='auto' SmolLM2-135M answers in prose ('The weather in San "
                 "Francisco is ...') instead of calling get_weather, in its own trained tool "
                 "format as in the fallback prompt (measured 2026-12-03)")
MODEL_XFAILS: dict[str, str] = {
    "test_json_mode": "JSON mode forces only some JSON object: SmolLM2-135M writes a long "
                      "'setup' string and closes the object without the 'punchline' key the "
                      "prompt asks for (measured 2026-12-03)",
    "test_agent_loop": _NO_AUTO_CALL,
}


class TestChatMLXBatchDefaultModel(CacheReadUsage, ChatModelIntegrationTests):
    """The integration suite against ``ChatMLXBatch()`` on the default model."""

    @pytest.fixture
    def model(self, request: pytest.FixtureRequest) -> BaseChatModel:
        node = request.node
        reason = MODEL_XFAILS.get(node.name) or MODEL_XFAILS.get(node.originalname)
        if reason:
            node.add_marker(pytest.mark.xfail(reason=reason))
        extra = getattr(request, "param", None) or {}
        return ChatMLXBatch(**{**self.chat_model_params, **extra})

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatMLXBatch

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"max_tokens": 256, "temperature": 0}

    @property
    def supports_json_mode(self) -> bool:
        return True
