"""The invariant of every constrained reply: it never leaves its grammar.

For each family's tiny random-weight model (random logits push against the mask at every
step) and the tiny SmolLM2-vocabulary model, hypothesis generates agent histories (answered
and unanswered calls whose arguments hold quotes, escapes, newlines, call markers and long
texts) and a constrained turn of every kind: JSON schema, JSON object, regex, Lark, a
required call, a named call, the tools-or-answer union, free text under a reasoning
budget; each with and without a budget, ``tool_call_limit`` and ``repeat_answered_calls``
both ways, one to three requests in one batch. Every reply is checked against the grammar
the engine itself built for it (``Preparer.prepare``, compiled afresh): each generated
token is one the grammar admits; a reply that ends by stop is complete in it; and what the
faces read from it (calls, JSON content, the regex's text) agrees. A request either does
that or fails with the engine's typed request error: never text outside its constraint.

Bounded for ``make test``: one model per dialect, ``MLX_PROVIDERS_FUZZ_EXAMPLES`` // 30
examples each (default 4); ``make fuzz`` (more examples) runs every family.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import (
    ChatRequest,
    Completion,
    Engine,
    EngineConfig,
    FinishReason,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
    RequestError,
    SamplingParams,
    Usage,
)
from engine.requests.prepare import Preparer
from testkit.families import FAMILIES, AssetUnavailable, built_family_model
from testkit.families.catalog import one_per_dialect
from tests.conftest import _built, _cache_root

EXAMPLES = max(2, int(os.environ.get("MLX_PROVIDERS_FUZZ_EXAMPLES", "120")) // 30)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# ----- the tools and constraints a turn may carry ----------------------------------------

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "integer"}},
            "required": ["a", "b"]},
    "search": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1,
                                                     "maximum": 10}},
        "required": ["query"]},
}
REPORT = {"type": "object", "properties": {
    "city": {"type": "string"}, "temperature": {"type": "number"},
    "tags": {"type": "array", "items": {"enum": ["sun", "rain", "wind"]}}},
    "required": ["city", "temperature"]}
PATTERN = r"(yes|no)(, because [a-z ]{1,12})?"
LARK = 'start: "A" | "B" NUMBER\n%import common.NUMBER'
KINDS = ["json_schema", "json_object", "regex", "lark", "required", "named", "union",
         "budgeted_text"]


def openai_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool",
                                             "parameters": TOOLS[name]}}


# ----- strategies ----------------------------------------------------------------------

# Argument text that a call reader can trip on: quotes, escapes, newlines, braces and the
# families' own call markers, and runs long enough to deepen the repeat guard's patterns.
TRICKY = ['"', "\\", "\n", "}", "{", "</tool_call>", "<tool_call>", "[TOOL_CALLS]", "é",
          ", ", "Paris", "21 C", ":", ";", "<|call|>", "</think>"]
argument_text = st.lists(st.sampled_from(TRICKY) | st.text(max_size=6), max_size=12).map(
    "".join) | st.text(alphabet="abc ,", min_size=40, max_size=160)


def arguments_for(name: str) -> st.SearchStrategy[dict[str, Any]]:
    if name == "add":
        return st.fixed_dictionaries({"a": st.integers(-5, 99), "b": st.integers(-5, 99)})
    if name == "search":
        return st.fixed_dictionaries({"query": argument_text},
                                     optional={"max_results": st.integers(1, 10)})
    return st.fixed_dictionaries({"city": argument_text},
                                 optional={"unit": st.sampled_from(["celsius", "fahrenheit"])})


@st.composite
def histories(draw: st.DrawFn, names: list[str]) -> list[dict[str, Any]]:
    """A user question, then assistant turns of calls, each answered (or not yet)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather?"}]
    for turn in range(draw(st.integers(0, 3))):
        calls = []
        for i in range(draw(st.integers(1, 2))):
            name = draw(st.sampled_from(names))
            calls.append({"id": f"c{turn}x{i}abcd"[:9], "type": "function", "function": {
                "name": name, "arguments": json.dumps(draw(arguments_for(name)))}})
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        for call in calls:
            if draw(st.booleans()) or turn < 2:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": draw(st.sampled_from(["21 C", "ok", "3"]))})
    return messages


@st.composite
def turns(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(TOOLS)), min_size=1, max_size=3, unique=True))
    kind = draw(st.sampled_from(KINDS))
    return {
        "kind": kind,
        "names": names,
        "messages": draw(histories(names)),
        "named": draw(st.sampled_from(names)),
        "budget": draw(st.sampled_from([None, None, 0, 4])),
        "limit": draw(st.sampled_from([None, None, 1, 2])),
        "repeat": draw(st.booleans()),
        "parallel": draw(st.booleans()),
        "max_tokens": draw(st.integers(8, 32)),
    }


def request_of(turn: dict[str, Any]) -> ChatRequest:
    kind = turn["kind"]
    constraint = {"json_schema": JsonSchema(REPORT), "json_object": JsonObject(),
                  "regex": Regex(PATTERN), "lark": LarkGrammar(LARK),
                  "union": JsonSchema(REPORT)}.get(kind)
    choice = {"required": "required", "named": turn["named"]}.get(kind, "auto")
    tools = [openai_tool(n) for n in turn["names"]] if kind != "json_schema" or turn[
        "parallel"] else None
    params = SamplingParams(max_tokens=turn["max_tokens"], constraint=constraint,
                            reasoning_budget=turn["budget"], tool_call_limit=turn["limit"],
                            repeat_answered_calls=turn["repeat"])
    return ChatRequest.from_openai(turn["messages"], params, tools=tools, tool_choice=choice,
                                   parallel_tool_calls=turn["parallel"])


# ----- the check -------------------------------------------------------------------------

def grammar_problem(preparer: Preparer, request: ChatRequest, done: Completion) -> str | None:
    """Why the reply is not in the grammar the engine built for it, or None."""
    constraint = preparer.prepare(request).params.constraint
    if constraint is None:
        return None
    matcher = preparer.compiler.compile(constraint).deep_copy()
    for i, token in enumerate(done.token_ids):
        if not matcher.consume_token(token):
            return f"token {i} ({token}) left the grammar: {done.text!r}"
    if done.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
        stops = preparer.stop_ids(request.params)
        if not matcher.is_accepting() and not any(
                matcher.validate_tokens([s]) for s in stops):
            return f"ended by stop before the grammar was complete: {done.text!r}"
    return None


def face_problem(request: ChatRequest, kind: str, done: Completion) -> str | None:
    """Why what a face reads from a complete reply disagrees with its constraint."""
    if done.finish_reason not in (FinishReason.STOP, FinishReason.TOOL_CALLS):
        return None
    # Tools beside a JSON answer (or free text) may be called; a regex or Lark grammar
    # stands alone.
    calls = bool(request.tools) and kind not in ("regex", "lark")
    if done.tool_calls or done.invalid_tool_calls:
        if not calls:
            return f"calls in a reply that may not call: {done.text!r}"
        if done.invalid_tool_calls:
            return f"invalid calls {done.invalid_tool_calls} in {done.text!r}"
        for call in done.tool_calls:
            if kind == "named" and call.name != request.tool_choice:
                return f"called {call.name}, not the named {request.tool_choice}"
            jsonschema.validate(call.arguments, TOOLS[call.name])
        return None
    if kind in ("required", "named"):
        return f"a forced call ended without a call: {done.text!r}"
    content = done.content.strip()
    if kind == "budgeted_text":
        return None  # free text, or the union of calls and free text
    if kind in ("json_schema", "union"):
        jsonschema.validate(json.loads(content), REPORT)
    elif kind == "json_object" and not isinstance(json.loads(content), dict):
        return f"not a JSON object: {content!r}"
    elif kind == "regex" and re.fullmatch(PATTERN, done.content) is None:
        return f"{done.content!r} does not match {PATTERN!r}"
    return None


# ----- the models ------------------------------------------------------------------------

# One model per dialect (the catalog's first of each; qwen3: tagged JSON after a
# prompt-opened reasoning block), every family when more examples are asked for.
ONE_PER_DIALECT = ["tiny-smollm2", *one_per_dialect()]
MODELS = ["tiny-smollm2", *sorted(FAMILIES)] if EXAMPLES > 4 else ONE_PER_DIALECT


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _cache_root(tmp_path_factory)
    if request.param == "tiny-smollm2":
        return _built(root / "tiny-qwen2-v3")
    try:
        return built_family_model(FAMILIES[request.param], root)
    except AssetUnavailable as exc:
        pytest.skip(f"{request.param}: a source of its tokenizer or template is missing: {exc}")


@pytest.fixture(scope="module")
def engine_and_preparer(model_dir: Path) -> Iterator[tuple[Engine, Preparer]]:
    eng = Engine(model_dir, EngineConfig(max_batch=8, prefill_chunk=256)).start()
    config = json.loads((model_dir / "config.json").read_text())
    vocab = (config.get("text_config") or config)["vocab_size"]
    yield eng, Preparer(eng.tokenizer, eng.model_path, vocab)
    eng.close()


@FUZZ
@given(batch=st.lists(turns(), min_size=1, max_size=3))
def test_a_constrained_reply_never_leaves_its_grammar(
        engine_and_preparer: tuple[Engine, Preparer], batch: list[dict[str, Any]]) -> None:
    eng, preparer = engine_and_preparer
    handles = []
    for turn in batch:
        request = request_of(turn)
        try:
            handles.append((turn, request, eng.submit(request)))
        except RequestError:
            continue  # refused at the door with the engine's own error: nothing generated
    for turn, request, handle in handles:
        try:
            done = handle.result(timeout=120)
        except RequestError as exc:
            assert str(exc), "a failed constrained request says why"
            continue
        problem = grammar_problem(preparer, request, done) or face_problem(
            request, turn["kind"], done)
        assert problem is None, f"{turn['kind']}: {problem}"
        if turn["budget"] is not None and done.finish_reason != FinishReason.LENGTH:
            assert done.usage.reasoning_tokens <= turn["budget"]


def test_the_checker_refuses_text_outside_the_grammar(
        engine_and_preparer: tuple[Engine, Preparer]) -> None:
    """The check can fail: prose under a JSON schema, or a JSON answer cut short that
    claims a stop, is reported."""
    _, preparer = engine_and_preparer
    request = request_of({"kind": "json_schema", "names": ["add"], "parallel": False,
                          "messages": [{"role": "user", "content": "hi"}], "named": "add",
                          "budget": None, "limit": None, "repeat": False, "max_tokens": 8})
    for text in ("You can use the weather", '{"city": "Paris"'):
        ids = tuple(preparer.tokenizer.encode(text, add_special_tokens=False))
        done = Completion(text, ids, FinishReason.STOP, Usage(), content=text)
        assert grammar_problem(preparer, request, done) is not None
