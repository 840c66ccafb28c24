"""The server's ``tool_call_limit`` extension reaches the engine request, and a limit below
one is a 400 naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mlx_providers.server.chat_request import ChatCompletionRequest, engine_request

HI = [{"role": "user", "content": "Hi"}]


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": HI, **fields})


def test_tool_call_limit_reaches_the_engine_request() -> None:
    limited = engine_request(_request(tool_call_limit=1), default_max_tokens=32,
                             default_temperature=0.0)
    plain = engine_request(_request(), default_max_tokens=32, default_temperature=0.0)
    assert (limited.params.tool_call_limit, plain.params.tool_call_limit) == (1, None)


@pytest.mark.parametrize("value", [0, -1, 1.5, "two"])
def test_a_limit_below_one_or_not_an_integer_is_refused(value: object) -> None:
    with pytest.raises(ValidationError, match="tool_call_limit"):
        _request(tool_call_limit=value)
