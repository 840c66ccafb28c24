"""Generated garbage thrown at ``Engine.submit`` while a long greedy row decodes.

Every example must end in success or in a clear error: TypeError/ValueError (the engine's
own request errors subclass them) at the door or from the request alone, or its own
timeout. Never an internal error type, never a failure of the engine itself. Meanwhile a
long greedy row streams; its tokens must equal its run alone: a request refused or failed
disturbs nothing in flight.

Bounded for CI: ``MLX_PROVIDERS_FUZZ_EXAMPLES`` (default 120) examples per test; ``make
fuzz`` runs many more.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
    RequestHandle,
    RequestTimeoutError,
    SamplingParams,
    TextRequest,
)
from tests.conftest import request_for

EXAMPLES = int(os.environ.get("MLX_PROVIDERS_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
CLEAR_ERRORS = (TypeError, ValueError, RequestTimeoutError)
LONG_PROMPT = [{"role": "user", "content": "Tell me a very long story about the sea."}]
# Long enough to outlast many examples, short enough that its reference run and the wait
# for the last one stay cheap: when one ends the next starts, and every one is checked.
LONG_PARAMS = SamplingParams(max_tokens=300, ignore_eos=True)


# ----- strategies: garbage shaped like what callers pass ---------------------------------

ROLES = ["system", "developer", "user", "assistant", "tool", "function", "USER", "wizard", ""]
KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "function", "arguments",
        "type", "text", "parameters", "properties", "required", "description", "id"]

scalars = (st.none() | st.booleans() | st.integers(-3, 3) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
           | st.binary(max_size=3) | st.sampled_from(ROLES))
garbage = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner)
                   | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner,
                                     max_size=4)),
    max_leaves=8)
texts = st.text(max_size=12)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                        "text": texts | garbage}) | texts | garbage,
                 max_size=3)
arguments = st.dictionaries(st.text(max_size=3), scalars, max_size=2) | texts | garbage
calls = st.lists(st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(["f", ""]) | garbage,
                                        "arguments": arguments})},
    optional={"id": texts | garbage, "type": st.just("function") | garbage}) | garbage,
    max_size=2)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | garbage},
    optional={"content": texts | parts | garbage, "tool_calls": calls | garbage,
              "tool_call_id": texts | garbage, "name": texts | garbage})
token_ids = st.lists(st.integers(-2, 2300) | st.sampled_from([2**31, 10**30]) | scalars,
                     min_size=0, max_size=6)
prompts = (texts | token_ids | st.lists(messages, max_size=3) | garbage
           | st.lists(st.sampled_from(LONG_PROMPT) | messages | scalars, max_size=3))
schemas = st.fixed_dictionaries(
    {}, optional={"type": st.sampled_from(["object", "string", "array"]) | garbage,
                  "properties": st.dictionaries(st.text(max_size=3),
                                                st.fixed_dictionaries({"type": st.sampled_from(
                                                    ["integer", "string", "nope"])}) | garbage,
                                                max_size=2) | garbage,
                  "required": st.lists(st.text(max_size=3), max_size=2) | garbage})
tools = st.none() | garbage | st.lists(
    st.fixed_dictionaries({"type": st.just("function") | garbage,
                           "function": st.fixed_dictionaries(
                               {"name": st.sampled_from(["f", "g", "a b"]) | garbage},
                               optional={"parameters": schemas | garbage,
                                         "description": texts | garbage})}) | garbage,
    max_size=2)
tool_choices = st.none() | st.sampled_from(["auto", "none", "required", "any", "f", "g"]) | \
    st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.just("f") | garbage})}) \
    | garbage
# Constraints are built inside the submitting call (a bad one raises when built), so these
# are makers: zero-argument callables, or garbage that is not a constraint at all.
constraints = st.none() | garbage | st.just(JsonObject) | st.builds(
    lambda schema: lambda: JsonSchema(schema),
    schemas | garbage | st.just({"type": "object", "properties": {"a": {"type": "integer"}}})
) | st.builds(lambda pattern: lambda: Regex(pattern),
              st.sampled_from(["[ab]{1,3}", "(", "x+", ""]) | garbage) | st.builds(
    lambda grammar: lambda: LarkGrammar(grammar),
    st.sampled_from(['start: "yes" | "no"', "garbage ::"]) | garbage)
small_ints = st.integers(-2, 4) | st.sampled_from([2**31, 10**9])
sampling = st.fixed_dictionaries(
    {"max_tokens": small_ints | garbage},
    optional={"temperature": st.floats(-1, 3) | garbage, "top_k": small_ints | garbage,
              "top_p": st.floats(-0.5, 1.5) | garbage, "seed": st.integers() | garbage,
              "stop": st.lists(texts, max_size=2) | garbage,
              "stop_token_ids": st.lists(st.integers(-1, 3000), max_size=2) | garbage,
              "repetition_penalty": st.floats(0.5, 2) | garbage, "constraint": constraints,
              "logprobs": st.booleans() | garbage, "top_logprobs": small_ints | garbage})
submit_options = st.fixed_dictionaries(
    {}, optional={"tools": tools, "tool_choice": tool_choices,
                  "parallel_tool_calls": st.booleans() | garbage,
                  "chat_template_kwargs": st.none() | garbage
                  | st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x"]), scalars,
                                    max_size=2),
                  "timeout": st.none() | st.floats(0.001, 30) | garbage,
                  "on_token": st.none() | garbage})


# ----- the long row that must not notice -------------------------------------------------

class LongRows:
    """Keeps a long greedy row decoding: when one finishes the next starts. Every one must
    produce exactly the tokens of its run alone."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.alone = engine.submit(request_for(LONG_PROMPT,
                                               LONG_PARAMS)).result(timeout=120).token_ids
        self.finished: list[tuple[int, ...]] = []
        self.current: RequestHandle | None = None
        self.examples_beside = 0

    def keep_running(self) -> None:
        if self.current is not None and self.current.done:
            self.finished.append(self.current.result().token_ids)
            self.current = None
        if self.current is None:
            self.current = self.engine.submit(request_for(LONG_PROMPT, LONG_PARAMS))
        self.examples_beside += 1

    def check(self) -> None:
        if self.current is not None:
            self.finished.append(self.current.result(timeout=120).token_ids)
        assert self.finished, "no long row ran"
        for tokens in self.finished:
            assert tokens == self.alone


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(tiny_model_dir, EngineConfig(max_batch=16, prefill_chunk=64)) as eng:
        yield eng.start()


@pytest.fixture
def long_rows(engine: Engine) -> Iterator[LongRows]:
    rows = LongRows(engine)
    yield rows
    rows.check()
    assert engine.submit(TextRequest("still alive",
                                     SamplingParams(max_tokens=2))).result(timeout=60)


def outcome(submit: Callable[[], RequestHandle]) -> str:
    """"refused" (clear error at the door), "failed" (clear error of the request) or "ok"."""
    try:
        handle = submit()
    except CLEAR_ERRORS as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return "refused"
    try:
        handle.result(timeout=120)
    except CLEAR_ERRORS as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return "failed"
    return "ok"


def bounded(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sampling kwargs whose accepted requests stay short (the fuzz must stay fast), with
    the constraint built (which may raise, as building it would for a caller)."""
    if callable(kwargs.get("constraint")):
        kwargs = {**kwargs, "constraint": kwargs["constraint"]()}
    max_tokens = kwargs.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 4 < max_tokens < 2**31:
        kwargs = {**kwargs, "max_tokens": 10**9}  # still refused, now by the context limit
    return kwargs


# ----- the tests ---------------------------------------------------------------------------

def test_garbage_prompts_fail_clearly_beside_a_long_row(engine: Engine,
                                                        long_rows: LongRows) -> None:
    seen: set[str] = set()

    @FUZZ
    @given(prompt=prompts, options=submit_options)
    def check(prompt: Any, options: dict[str, Any]) -> None:
        long_rows.keep_running()
        door = {k: options.pop(k) for k in ("on_token", "timeout") if k in options}
        seen.add(outcome(lambda: engine.submit(
            request_for(prompt, SamplingParams(max_tokens=2), **options), **door)))

    check()
    assert "refused" in seen


def test_garbage_sampling_and_constraints_fail_clearly_beside_a_long_row(
        engine: Engine, long_rows: LongRows) -> None:
    seen: set[str] = set()

    @FUZZ
    @given(kwargs=sampling, prompt=st.sampled_from(["Say yes", [5, 6, 7], LONG_PROMPT]))
    def check(kwargs: dict[str, Any], prompt: Any) -> None:
        long_rows.keep_running()

        def submit() -> RequestHandle:
            return engine.submit(request_for(prompt, SamplingParams(**bounded(kwargs))))

        seen.add(outcome(submit))

    check()
    assert "refused" in seen


def test_garbage_tools_fail_clearly_beside_a_long_row(engine: Engine,
                                                      long_rows: LongRows) -> None:
    @FUZZ
    @given(tool_list=tools, choice=tool_choices, parallel=st.booleans())
    def check(tool_list: Any, choice: Any, parallel: bool) -> None:
        long_rows.keep_running()
        outcome(lambda: engine.submit(ChatRequest.from_openai(
            LONG_PROMPT, SamplingParams(max_tokens=3), tools=tool_list, tool_choice=choice,
            parallel_tool_calls=parallel)))

    check()


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2**64, -1, 1e308])
def test_extreme_numbers_never_reach_the_engine_thread(engine: Engine, long_rows: LongRows,
                                                       value: Any) -> None:
    """Seeds, top_k and token ids outside what mlx takes used to kill the engine thread or
    fail every row of the batch step; now each is refused or fails its own request."""
    long_rows.keep_running()
    for field in ("seed", "top_k", "max_tokens", "repetition_context_size", "temperature"):
        assert outcome(lambda f=field: engine.submit(TextRequest(  # type: ignore[misc]
            "x", SamplingParams(**{f: value, "temperature": 1.0} if f != "temperature"
                                else {f: value})))) in ("refused", "failed", "ok")
    assert outcome(lambda: engine.submit(TextRequest([value], SamplingParams(max_tokens=1)))
                   ) == "refused"
    assert outcome(lambda: engine.submit(TextRequest("x", SamplingParams(
        max_tokens=1, top_k=3000, temperature=1.0)))) == "failed"
