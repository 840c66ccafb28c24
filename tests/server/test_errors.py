"""Bad input is a 4xx in OpenAI's error shape naming the parameter; failures never kill
the server; capacity answers 429; /health says when the engine is dead; auth."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from engine import Engine, StepProbe
from mlx_providers.server import ServerSettings
from tests.conftest import wait_until
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]
HI = [{"role": "user", "content": "hi"}]


def post(server: LiveServer, body: Any, path: str = "/v1/chat/completions",
         **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


CHAT_CASES: list[tuple[dict[str, Any], str, str | None]] = [
    ({"messages": HI}, "model", "missing_required_parameter"),
    ({"model": "tiny"}, "messages", "missing_required_parameter"),
    ({"model": "tiny", "messages": "hi"}, "messages", "invalid_value"),
    ({"model": "tiny", "messages": []}, "messages", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].input_audio", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "file"}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"model": "tiny", "messages": HI, "temperature": "hot"}, "temperature", "invalid_value"),
    ({"model": "tiny", "messages": HI, "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "tiny", "messages": HI, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "tiny", "messages": HI, "n": 2}, "n", "invalid_value"),
    ({"model": "tiny", "messages": HI, "stop": [""]}, "stop", "invalid_value"),
    ({"model": "tiny", "messages": HI, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"model": "tiny", "messages": HI, "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name", "missing_required_parameter"),
    ({"model": "tiny", "messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools", "invalid_value"),
    ({"model": "tiny", "messages": HI, "tool_choice": "required"}, "tool_choice",
     "invalid_value"),
    ({"model": "tiny", "messages": HI, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "invalid_value"),
    ({"model": "tiny", "messages": HI, "response_format": {"type": "json_schema"}},
     "response_format", "invalid_value"),
    ({"model": "tiny", "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
]


@pytest.mark.parametrize(("body", "param", "code"), CHAT_CASES,
                         ids=[c[1] + "-" + str(i) for i, c in enumerate(CHAT_CASES)])
def test_invalid_chat_requests_are_400_naming_the_parameter(
        live_server: LiveServer, body: dict[str, Any], param: str, code: str) -> None:
    error = error_of(post(live_server, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["code"] == code


RESPONSES_CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"model": "tiny", "input": [{"type": "teleport"}]}, "input[0]"),
    # A type that is not a string was a 500 (unhashable) until the fuzz test found it.
    ({"model": "tiny", "input": [{"type": []}]}, "input[0]"),
    ({"model": "tiny", "input": [{"type": {"a": 1}}]}, "input[0]"),
    ({"model": "tiny", "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema"}}},
     "text.format.schema"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
]


@pytest.mark.parametrize(("body", "param"), RESPONSES_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(RESPONSES_CASES)])
def test_invalid_responses_requests_are_400_naming_the_parameter(
        live_server: LiveServer, body: dict[str, Any], param: str) -> None:
    error = error_of(post(live_server, body, "/v1/responses"), 400)
    assert error["param"] is not None and error["param"].startswith(param), error


def test_unknown_model_and_model_paths_are_404_and_never_loaded(
        live_server: LiveServer, tiny_model_dir: Any) -> None:
    for model in ("gpt-4o", str(tiny_model_dir), "HuggingFaceTB/SmolLM2-135M-Instruct"):
        error = error_of(post(live_server, {"model": model, "messages": HI}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        error = error_of(post(live_server, {"model": model, "input": "x"}, "/v1/responses"),
                         404)
        assert error["code"] == "model_not_found"


def test_context_overflow_is_400_context_length_exceeded(live_server: LiveServer) -> None:
    long = [{"role": "user", "content": "word " * 3000}]
    for stream in (False, True):
        error = error_of(post(live_server, {"model": "tiny", "messages": long,
                                            "stream": stream}), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    error = error_of(post(live_server, {"model": "tiny", "input": "hi",
                                        "max_output_tokens": 100_000}, "/v1/responses"), 400)
    assert error["code"] == "context_length_exceeded"


def test_without_a_token_limit_a_long_prompt_gets_the_room_the_context_has_left(
        live_server: LiveServer) -> None:
    """No max_tokens (as OpenAI clients send): the server's default (512) would overflow
    the tiny model's 2048-token context, so the answer gets what is left instead."""
    long = [{"role": "user", "content": "word " * 850}]
    response = post(live_server, {"model": "tiny", "messages": long})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert 1536 < usage["prompt_tokens"] < 2048
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 2048
    explicit = post(live_server, {"model": "tiny", "messages": long, "max_tokens": 512})
    assert error_of(explicit, 400)["code"] == "context_length_exceeded"
    for stream in (False, True):
        r = post(live_server, {"model": "tiny", "input": "word " * 850, "stream": stream},
                 "/v1/responses")
        assert r.status_code == 200, r.text


def test_malformed_json_and_non_objects_are_400(live_server: LiveServer) -> None:
    assert error_of(post(live_server, b"{not json"), 400)["code"] == "invalid_json"
    assert error_of(post(live_server, b"[1, 2]"), 400)["code"] == "invalid_json"


def test_unknown_paths_and_methods_use_the_error_shape(live_server: LiveServer) -> None:
    error_of(httpx.get(live_server.url + "/v1/nothing", timeout=10), 404)
    error_of(httpx.get(live_server.url + "/v1/chat/completions", timeout=10), 405)
    error_of(httpx.get(live_server.url + "/v1/responses/resp_nope", timeout=10), 404)
    error_of(httpx.delete(live_server.url + "/v1/responses/resp_nope", timeout=10), 404)


def test_the_server_still_serves_after_every_bad_request(live_server: LiveServer) -> None:
    """Run last in this module's order: all the errors above left it healthy."""
    assert httpx.get(live_server.url + "/health", timeout=10).status_code == 200
    ok = post(live_server, {"model": "tiny", "messages": HI, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_an_oversized_body_is_413(serve: Serve) -> None:
    server, _ = serve(ServerSettings(max_body_bytes=2000))
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert error_of(post(server, big), 413)["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: the limit holds while reading
        yield json.dumps(big).encode()

    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30)
    assert error_of(response, 413)["code"] == "request_too_large"


def test_a_full_queue_answers_429_with_retry_after(serve: Serve,
                                                   slow_steps: Callable[[float], None]) -> None:
    server, eng = serve(ServerSettings(max_queue=1), max_batch=1)
    slow_steps(0.05)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    running = client.chat.completions.create(model="tiny", messages=HI, max_tokens=500,  # type: ignore[arg-type]
                                             stream=True)
    held: list[Any] = []
    waiter = threading.Thread(target=lambda: held.append(post(server, {
        "model": "tiny", "messages": HI, "max_tokens": 2})))
    waiter.start()  # the queued one: capacity max_batch 1 + max_queue 1 is now full
    wait_until(lambda: eng.stats().pending == 1)
    response = post(server, {"model": "tiny", "messages": HI, "max_tokens": 2})
    error = error_of(response, 429)
    assert error["code"] == "rate_limit_exceeded" and response.headers["retry-after"] == "1"
    running.close()
    waiter.join(60)
    assert held and held[0].status_code == 200


def test_health_is_503_once_the_engine_is_dead(serve: Serve, step_probe: StepProbe) -> None:
    server, _ = serve(max_consecutive_step_failures=1)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    step_probe.fail_always(RuntimeError("simulated device failure"))
    response = post(server, {"model": "tiny", "messages": HI, "max_tokens": 5})
    assert response.status_code in (500, 503), response.text
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["models"]["tiny"].startswith("dead")
    error = error_of(post(server, {"model": "tiny", "messages": HI}), 503)
    assert error["type"] == "server_error"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200  # still up


def test_with_an_api_key_every_endpoint_but_health_needs_it(serve: Serve) -> None:
    server, _ = serve(ServerSettings(api_key="s3cret"))
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
                             ("GET", "/v1/responses/resp_x")):
            response = httpx.request(method, server.url + path, headers=headers, timeout=10)
            assert error_of(response, 401)["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
    assert [m.id for m in good.models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()
