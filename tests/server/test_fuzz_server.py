"""Generated garbage POSTed to the server while a long greedy row decodes on its engine.

Every request gets a 2xx or a 4xx in OpenAI's error shape: never a 5xx, never a dead
server. The long row's tokens must equal its run alone. Bounded by
``MLX_PROVIDERS_FUZZ_EXAMPLES`` like the engine's fuzz tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import Engine
from tests.engine.test_fuzz_engine import FUZZ, KEYS, ROLES, LongRows
from tests.server.conftest import LiveServer

# JSON-able garbage: what a client can actually send.
json_scalars = (st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
                | st.sampled_from(ROLES))
json_garbage = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4),
    max_leaves=8)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | json_garbage},
    optional={"content": st.text(max_size=12) | json_garbage,
              "tool_calls": json_garbage, "tool_call_id": json_garbage}), max_size=3)
tools = st.lists(st.fixed_dictionaries(
    {"type": st.just("function") | json_garbage,
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "a b"]) | json_garbage},
                                       optional={"parameters": json_garbage})}), max_size=2)
# Accepted requests must stay short: a limit of 1-4 tokens, or garbage that is refused.
limits = st.integers(1, 4) | st.sampled_from([0, -1, 2**40]) | json_garbage
chat_bodies = st.fixed_dictionaries(
    {"model": st.just("tiny") | json_garbage, "max_tokens": limits},
    optional={"messages": messages | json_garbage, "tools": tools | json_garbage,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_garbage,
              "response_format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["json_object", "json_schema", "text", "x"])},
                  optional={"json_schema": json_garbage}) | json_garbage,
              "temperature": json_scalars, "top_p": json_scalars, "seed": json_scalars,
              "stop": json_garbage, "logprobs": json_scalars, "top_logprobs": json_scalars,
              "stream": st.booleans() | json_garbage, "n": json_scalars})
user_turns = st.lists(st.fixed_dictionaries(
    {"role": st.just("user"), "content": st.text(min_size=1, max_size=12)}), min_size=1,
    max_size=2)
# Well-formed requests with one field of garbage at most, so some are accepted.
near_valid_chat = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 4), "messages": user_turns},
    optional={"temperature": json_scalars, "stop": json_garbage, "seed": json_scalars})
responses_bodies = st.fixed_dictionaries(
    {"model": st.just("tiny") | json_garbage, "max_output_tokens": limits},
    optional={"input": st.text(max_size=12) | messages | json_garbage,
              "instructions": json_garbage, "tools": json_garbage,
              "text": st.fixed_dictionaries({"format": json_garbage}) | json_garbage,
              "previous_response_id": json_garbage, "store": json_scalars,
              "stream": st.booleans() | json_garbage})


@pytest.fixture
def long_rows(server_engine: Engine) -> Iterator[LongRows]:
    rows = LongRows(server_engine)
    yield rows
    rows.check()


def _check(server: LiveServer, path: str, body: Any, long_rows: LongRows,
           statuses: set[int]) -> None:
    long_rows.keep_running()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post(path, json=body)
        text = response.read().decode()
    statuses.add(response.status_code)
    assert response.status_code < 500, (body, response.status_code, text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error


def test_garbage_chat_completions_get_4xx_beside_a_long_row(
        live_server: LiveServer, long_rows: LongRows) -> None:
    statuses: set[int] = set()

    @FUZZ
    @given(body=chat_bodies | near_valid_chat | json_garbage)
    def check(body: Any) -> None:
        _check(live_server, "/v1/chat/completions", body, long_rows, statuses)

    check()
    assert 200 in statuses and 400 in statuses, statuses
    assert httpx.get(live_server.url + "/health", timeout=10).status_code == 200


def test_garbage_responses_get_4xx_beside_a_long_row(
        live_server: LiveServer, long_rows: LongRows) -> None:
    statuses: set[int] = set()

    @FUZZ
    @given(body=responses_bodies | st.fixed_dictionaries(
        {"model": st.just("tiny"), "max_output_tokens": st.integers(16, 20),
         "input": st.text(min_size=1, max_size=12)}) | json_garbage)
    def check(body: Any) -> None:
        _check(live_server, "/v1/responses", body, long_rows, statuses)

    check()
    assert 200 in statuses and 400 in statuses, statuses
    assert httpx.get(live_server.url + "/health", timeout=10).status_code == 200
