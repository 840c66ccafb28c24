"""Validation at the engine's door, without a model: every bad input is a TypeError or a
ValueError (or the engine's own errors, which subclass them) naming the argument.

A request is checked when its value is built (``ChatRequest.from_openai``, ``TextRequest``),
and ``checked_request`` is what ``Engine.submit`` adds on the caller's thread before anything
is queued; ``Engine.submit``'s own checks (on_token, timeout) are ``check_callbacks``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    InvalidConstraintError,
    JsonSchema,
    LarkGrammar,
    Regex,
    SamplingParams,
    TextRequest,
)
from engine.requests.inbound.sampling import check_callbacks
from engine.requests.prepare import checked_request

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}


def spec(prompt: Any = (USER,), params: Any = None, tools: Any = None, tool_choice: Any = None,
         parallel_tool_calls: Any = True, chat_template_kwargs: Any = None) -> Any:
    """What the door makes of a prompt and options: chat messages (a list whose first item
    is a dict) as a ``ChatRequest``, anything else as a ``TextRequest``, then checked."""
    prompt = list(prompt) if isinstance(prompt, tuple) else prompt
    params = SamplingParams() if params is None else params
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        request: Any = ChatRequest.from_openai(
            prompt, params, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs,
            root="prompt")
    else:
        request = TextRequest(prompt, params)
    return checked_request(request)


def raises(kind: type[BaseException], match: str) -> Any:
    return pytest.raises(kind, match=match)


# ----- prompts ----------------------------------------------------------------------------

BAD_PROMPTS: list[tuple[Any, type[BaseException], str]] = [
    (None, TypeError, "prompt must be"),
    (5, TypeError, "prompt must be"),
    (3.5, TypeError, "prompt must be"),
    (b"hi", TypeError, "prompt must be"),
    (USER, TypeError, "one message"),
    ("", ValueError, "prompt is empty"),
    ([], ValueError, "prompt is empty"),
    ([1.0, 2.0], TypeError, r"prompt\[0\] must be an integer token id"),
    ([float("inf")], TypeError, r"prompt\[0\]"),
    ([float("nan")], TypeError, r"prompt\[0\]"),
    (["a"], TypeError, r"prompt\[0\]"),
    ([True], TypeError, r"prompt\[0\].*bool"),
    ([None], TypeError, r"prompt\[0\]"),
    ([-1], ValueError, "out of range"),
    ([10**30], ValueError, "out of range"),
    ([1, USER], TypeError, r"prompt\[1\] is a dict"),
    ([USER, "x"], TypeError, r"prompt\[1\] must be a chat message"),
    ([USER, 3], TypeError, r"prompt\[1\] must be a chat message"),
    ([{}], ValueError, r"prompt\[0\]\.role"),
    ([{"content": "hi"}], ValueError, r"prompt\[0\]\.role"),
    ([{"role": "wizard", "content": "hi"}], ValueError, r"prompt\[0\]\.role"),
    ([{"role": 3, "content": "hi"}], ValueError, r"prompt\[0\]\.role"),
    ([{"role": None, "content": "hi"}], ValueError, r"prompt\[0\]\.role"),
    ([{"role": "USER", "content": "hi"}], ValueError, r"prompt\[0\]\.role"),
    ([{"role": "user", "content": b"hi"}], TypeError, r"prompt\[0\]\.content"),
    ([{"role": "user", "content": 5}], TypeError, r"prompt\[0\]\.content"),
    ([{"role": "user", "content": None}], TypeError, r"prompt\[0\]\.content"),
    ([{"role": "user"}], TypeError, r"prompt\[0\]\.content"),
    ([{"role": "user", "content": {"type": "text", "text": "hi"}}], TypeError,
     r"prompt\[0\]\.content"),
    ([{"role": "user", "content": [1, 2]}], ValueError, r"prompt\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     ValueError, r"prompt\[0\]\.content\[0\].*not valid base64"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], ValueError,
     r"prompt\[0\]\.content\[0\]"),
    ([USER, {"role": "tool", "content": [None, 3]}], ValueError, r"prompt\[1\]\.content\[0\]"),
    ([USER, {"role": "tool", "content": "r", "tool_call_id": 5}], TypeError,
     r"prompt\[1\]\.tool_call_id"),
    ([{"role": "user", "content": "hi", "name": 5}], TypeError, r"prompt\[0\]\.name"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], ValueError,
     r"prompt\[0\]\.tool_calls: only assistant"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": 5}], TypeError,
     r"prompt\[1\]\.tool_calls must be a list"),
    ([USER, {"role": "assistant", "tool_calls": {"function": {"name": "f"}}}], TypeError,
     r"prompt\[1\]\.tool_calls must be a list"),
    ([USER, {"role": "assistant", "tool_calls": [5]}], TypeError,
     r"prompt\[1\]\.tool_calls\[0\] must be a tool call"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": 5}]}], TypeError,
     r"prompt\[1\]\.tool_calls\[0\]\.function"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}], ValueError,
     r"prompt\[1\]\.tool_calls\[0\]\.function\.name"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": 3, "function": {"name": "f"}}]}],
     TypeError, r"prompt\[1\]\.tool_calls\[0\]\.id"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}], ValueError,
     r"tool_calls\[0\]\.function\.arguments is not JSON"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}], ValueError,
     r"arguments must be a JSON object"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": 5}}]}], TypeError, r"arguments must be a dict"),
]


@pytest.mark.parametrize(("prompt", "kind", "match"), BAD_PROMPTS,
                         ids=[f"prompt-{i}" for i in range(len(BAD_PROMPTS))])
def test_bad_prompts_are_named_at_the_door(prompt: Any, kind: type[BaseException],
                                           match: str) -> None:
    with raises(kind, match):
        spec(prompt)


def test_good_prompts_pass_as_private_copies() -> None:
    import numpy as np

    ids = [1, 2, 3]
    assert TextRequest(ids).prompt == (1, 2, 3)  # a tuple: a private copy
    assert TextRequest((4, 5)).prompt == (4, 5)
    assert TextRequest(np.array([7, 8], dtype=np.int64)).prompt == (7, 8)
    assert TextRequest("text").prompt == "text"
    messages = [{"role": "system", "content": "s"}, USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": [{"type": "text", "text": "3"}], "tool_call_id": "c1"},
                {"role": "assistant", "content": ["a", {"type": "text", "text": "b"}]}]
    checked = ChatRequest.from_openai(messages).messages  # typed values (the rulebook's)
    assert isinstance(checked, tuple)
    assert checked[3].content == "3" and checked[4].content == "ab"
    assert checked[0].as_openai() == messages[0] and checked[0] is not messages[0]
    messages[1]["content"] = "changed later"  # the queued copy does not see it
    assert checked[1].content == "hi"


# ----- tools and tool choice --------------------------------------------------------------

BAD_TOOLS: list[tuple[Any, Any, type[BaseException], str]] = [
    (5, None, TypeError, "tools must be a list"),
    ("abc", None, TypeError, "tools must be a list"),
    (TOOL, None, TypeError, "tools must be a list"),
    ([5], None, TypeError, r"tools\[0\] must be a dict"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, ValueError, r"tools\[0\]\.type"),
    ([{"function": 5}], None, TypeError, r"tools\[0\]\.function must be a dict"),
    ([{"function": {}}], None, ValueError, r"tools\[0\]\.function\.name"),
    ([{"function": {"name": 5}}], None, ValueError, r"tools\[0\]\.function\.name"),
    ([{"function": {"name": "a b"}}], None, ValueError, r"tools\[0\]\.function\.name"),
    ([{"function": {"name": "x" * 65}}], None, ValueError, r"tools\[0\]\.function\.name"),
    ([{"function": {"name": "f", "description": 5}}], None, TypeError, "description"),
    ([{"function": {"name": "f", "parameters": "{}"}}], None, TypeError, "parameters"),
    ([{"function": {"name": "f", "parameters": {"type": "string"}}}], None, ValueError,
     r"parameters\.type must be 'object'"),
    ([{"function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}], "auto",
     ValueError, r"parameters\.properties must be an object"),
    ([{"function": {"name": "f", "parameters": {"properties": [1]}}}], "none",
     ValueError, r"parameters\.properties must be an object"),
    ([{"function": {"name": "f", "parameters": {"properties": {"a": 5}}}}], None,
     ValueError, r"parameters\.properties\['a'\]"),
    ([{"function": {"name": "f", "parameters": {"required": "a"}}}], None,
     ValueError, r"parameters\.required"),
    ([{"function": {"name": "f", "parameters": {"properties": {"a": {"x": {1, 2}}}}}}], None,
     ValueError, r"parameters is not JSON"),
    ([TOOL, TOOL], None, ValueError, "duplicate tool names"),
    ([TOOL], 5, TypeError, "tool_choice must be"),
    ([TOOL], ["f"], TypeError, "tool_choice must be"),
    ([TOOL], "g", ValueError, "tool_choice names 'g'"),
    ([TOOL], {"type": "retrieval", "function": {"name": "f"}}, ValueError, "tool_choice type"),
    ([TOOL], {"function": "f"}, ValueError, "tool_choice dict must name"),
    (None, "required", ValueError, "tool_choice='required' needs"),
]


@pytest.mark.parametrize(("tools", "choice", "kind", "match"), BAD_TOOLS,
                         ids=[f"tools-{i}" for i in range(len(BAD_TOOLS))])
def test_bad_tools_and_choices_are_named(tools: Any, choice: Any, kind: type[BaseException],
                                         match: str) -> None:
    with raises(kind, match):
        spec(tools=tools, tool_choice=choice)


def test_good_tools_pass() -> None:
    flat = {"name": "ns.tool:x-1", "description": None, "parameters": {}}
    checked = spec(tools=[TOOL, flat], tool_choice={"type": "function", "function": {"name": "f"}})
    assert [t.name for t in checked.tools] == ["f", "ns.tool:x-1"]
    assert checked.tools[1].parameters == {"type": "object", "properties": {}}
    assert checked.tool_choice == "f"


# ----- submit options, sampling, constraints ----------------------------------------------

@pytest.mark.parametrize(("kwargs", "kind", "match"), [
    ({"parallel_tool_calls": "no"}, TypeError, "parallel_tool_calls must be a bool"),
    ({"parallel_tool_calls": None}, TypeError, "parallel_tool_calls must be a bool"),
    ({"chat_template_kwargs": "abc"}, TypeError, "chat_template_kwargs must be a dict"),
    ({"chat_template_kwargs": [1]}, TypeError, "chat_template_kwargs must be a dict"),
    ({"chat_template_kwargs": {1: 2}}, ValueError, "chat_template_kwargs keys"),
    ({"chat_template_kwargs": {"tools": []}}, ValueError, r"must not set \['tools'\]"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, ValueError, "must not set"),
    ({"params": {"max_tokens": 3}}, TypeError, "params must be SamplingParams"),
])
def test_bad_submit_options_are_named(kwargs: dict[str, Any], kind: type[BaseException],
                                      match: str) -> None:
    with raises(kind, match):
        spec(**kwargs)


@pytest.mark.parametrize(("on_token", "timeout", "kind", "match"), [
    (5, None, TypeError, "on_token must be"),
    (None, "5", TypeError, "timeout must be None or a number"),
    (None, True, TypeError, "timeout must be None or a number"),
    (None, 0, ValueError, "timeout must be a finite number"),
    (None, -1.0, ValueError, "timeout must be a finite number"),
    (None, math.inf, ValueError, "timeout must be a finite number"),
    (None, math.nan, ValueError, "timeout must be a finite number"),
])
def test_bad_callbacks_and_timeouts_are_named(on_token: Any, timeout: Any,
                                              kind: type[BaseException], match: str) -> None:
    with raises(kind, match):
        check_callbacks(on_token, timeout)


def test_good_callbacks_and_timeouts_pass() -> None:
    check_callbacks(None, None)
    check_callbacks(lambda token, text: None, 0.5)
    check_callbacks(None, 3)


@pytest.mark.parametrize(("field", "value"), [
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("top_k", 2**31), ("top_k", True),
    ("repetition_context_size", 2**31), ("max_tokens", 2**31), ("max_tokens", True),
    ("stop", 5), ("stop", b"ab"), ("stop", {"a": 1}), ("stop_token_ids", 2.0),
    ("stop_token_ids", [2**31]), ("stop_token_ids", [True]), ("logits_processors", 5),
    ("logits_processors", "abc"), ("temperature", math.inf), ("temperature", "hot"),
    ("top_p", math.nan), ("min_p", -0.1), ("repetition_penalty", math.inf),
    ("temperature", 10**400), ("ignore_eos", 1), ("constraint", "x"),
    ("constraint", {"type": "object"}), ("tool_call_limit", 0), ("tool_call_limit", 1.0),
    ("tool_call_limit", True),
])
def test_bad_sampling_values_name_the_field(field: str, value: Any) -> None:
    with raises(ValueError, f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_vocabulary_checks_name_the_field() -> None:
    params = SamplingParams(top_k=50, stop_token_ids=(7, 99))
    params.check_vocabulary(100)
    with raises(ValueError, "SamplingParams.top_k must be below the model's vocabulary"):
        SamplingParams(top_k=100).check_vocabulary(100)
    with raises(ValueError, r"SamplingParams.stop_token_ids out of range \[0, 60\)"):
        params.check_vocabulary(60)
    assert SamplingParams(logits_processors=print).logits_processors == (print,)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_integer_sampling_reals_reach_mlx_as_floats() -> None:
    # An int reaching mlx (2**64 overflowed int64) failed the whole batch step; floats do not.
    params = SamplingParams(temperature=2**64, top_p=1, min_p=0, repetition_penalty=1)
    assert [type(v) for v in (params.temperature, params.top_p, params.min_p,
                              params.repetition_penalty)] == [float] * 4


@pytest.mark.parametrize("build", [
    lambda: JsonSchema("5"), lambda: JsonSchema("[1, 2]"), lambda: JsonSchema(5),  # type: ignore[arg-type]
    lambda: JsonSchema("{oops"), lambda: JsonSchema({"a": {1, 2}}),
    lambda: Regex(5), lambda: Regex(""), lambda: LarkGrammar(None), lambda: LarkGrammar("  "),  # type: ignore[arg-type]
])
def test_bad_constraints_are_invalid_constraint_errors(build: Any) -> None:
    with pytest.raises(InvalidConstraintError):
        build()


# ----- the engine and its config ----------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("max_batch", "4"), ("max_batch", 4.0), ("max_batch", True), ("prefill_chunk", "64"),
    ("quantized", "yes"), ("quantized", 1), ("prefix_cache_ttl", math.inf),
    ("prefix_cache_ttl", math.nan), ("prefix_cache_ttl", "60"), ("kv_budget_bytes", 1.5),
])
def test_engine_config_types_are_strict(field: str, value: Any) -> None:
    with raises(ValueError, field):
        EngineConfig(**{field: value})


def test_engine_config_still_takes_numbers_it_means() -> None:
    config = EngineConfig(max_batch=4, prefix_cache_ttl=5, quantized=None)
    assert config.prefix_cache_ttl == 5.0 and config.max_batch == 4


@pytest.mark.parametrize(("model", "config", "kind", "match"), [
    (5, None, TypeError, "model must be"),
    (b"path", None, TypeError, "model must be"),
    ("", None, ValueError, "model must not be empty"),
    ("some/dir", {"max_batch": 2}, TypeError, "config must be an EngineConfig"),
])
def test_engine_arguments_are_checked_at_construction(model: Any, config: Any,
                                                      kind: type[BaseException],
                                                      match: str) -> None:
    with raises(kind, match):
        Engine(model, config)
