"""The chat-completions reasoning options reach the engine request: ``reasoning_effort`` as
a template variable (gpt-oss's template reads it), ``reasoning_budget`` as the row's budget."""

from __future__ import annotations

from mlx_providers.server.chat_request import ChatCompletionRequest, engine_request

HI = [{"role": "user", "content": "Hi"}]


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": HI, **fields})


def test_effort_and_budget_reach_the_engine_request() -> None:
    chat = engine_request(_request(reasoning_effort="low", reasoning_budget=64),
                          default_max_tokens=32, default_temperature=0.0)
    assert chat.template_kwargs["reasoning_effort"] == "low"
    assert chat.params.reasoning_budget == 64
    plain = engine_request(_request(), default_max_tokens=32, default_temperature=0.0)
    assert "reasoning_effort" not in plain.template_kwargs
    assert plain.params.reasoning_budget is None


def test_a_template_variable_the_client_set_wins_over_the_effort() -> None:
    chat = engine_request(_request(reasoning_effort="high",
                                   chat_template_kwargs={"reasoning_effort": "low"}),
                          default_max_tokens=32, default_temperature=0.0)
    assert chat.template_kwargs["reasoning_effort"] == "low"


def test_repeat_answered_calls_reaches_the_engine_request() -> None:
    on = engine_request(_request(repeat_answered_calls=True), default_max_tokens=32,
                        default_temperature=0.0)
    plain = engine_request(_request(), default_max_tokens=32, default_temperature=0.0)
    assert (on.params.repeat_answered_calls, plain.params.repeat_answered_calls) == (
        True, False)
