"""Tools beside a JSON schema in one request: the reply is a call or the schema's answer.

The union grammar (``engine.requests.constraints.tools_or_answer``) admits exactly those
two replies; both are reachable on the tiny model, a call comes back as a parsed tool call
and an answer as content valid for the schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from engine import ChatRequest, Engine, FinishReason, JsonSchema
from engine.errors import InvalidConstraintError, InvalidRequestError
from engine.requests.constraints.forced_calls import tagged_json_calls
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.constraints.tools_or_answer import tools_or_answer_grammar
from engine.requests.inbound.tool_specs import normalize_tools
from tests.conftest import greedy
from tests.unit.test_tools import WEATHER

# An answer the tiny model cannot ramble in: every value bounded.
VERDICT = {"type": "object", "properties": {
    "answer": {"enum": ["sunny", "rainy"]}, "degrees": {"type": "integer", "maximum": 50}},
    "required": ["answer", "degrees"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _biased(token: int) -> Callable[[Any, Any], Any]:
    """A logits processor that makes ``token`` the greedy pick at the first step only: the
    grammar then decides which branch that token may begin."""
    seen = [False]

    def process(tokens: Any, logits: Any) -> Any:
        if seen[0]:
            return logits
        seen[0] = True
        bump = mx.zeros(logits.shape[-1]).at[token].add(1e4)
        return logits + bump

    return process


def _union_request(bias: int | None = None, **kw: Any) -> ChatRequest:
    processors = (_biased(bias),) if bias is not None else ()
    return ChatRequest.from_openai(ASK, greedy(96, constraint=JsonSchema(VERDICT),
                                               logits_processors=processors),
                                   tools=[WEATHER], parallel_tool_calls=False, **kw)


def _token(eng: Engine, text: str) -> int:
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return int(ids[0])


def test_the_union_admits_a_call_or_the_answer_and_nothing_else(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(hf, vocab)
    calls = tagged_json_calls(normalize_tools([WEATHER]), "required", False,
                              compiler.lark_text("<tool_call>"), compiler.lark_text("</tool_call>"))
    grammar = tools_or_answer_grammar(calls, JsonSchema(VERDICT))

    def accepts(text: str) -> bool:
        matcher = compiler.compile(grammar).deep_copy()
        ids = hf.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                   '\n</tool_call>')
    assert accepts('{"answer": "sunny", "degrees": 21}')
    assert not accepts('{"answer": "foggy", "degrees": 21}')  # not the schema's
    assert not accepts('{"name": "get_weather", "arguments": {"city": "Paris"}}')  # no markers
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts("It is sunny.")


def test_a_call_comes_back_as_a_tool_call(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_union_request(_token(tiny_engine, "<tool_call>"))).result()
    assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    jsonschema.validate(result.tool_calls[0].arguments, WEATHER["function"]["parameters"])
    assert not result.invalid_tool_calls and result.content.strip() == ""


def test_an_answer_comes_back_as_content_valid_for_the_schema(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_union_request(_token(tiny_engine, "{"))).result()
    assert result.finish_reason is FinishReason.STOP, result.text
    assert not result.tool_calls
    jsonschema.validate(json.loads(result.content), VERDICT)


def test_unbiased_greedy_replies_are_one_or_the_other(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_union_request()).result()
    if result.tool_calls:
        assert [c.name for c in result.tool_calls] == ["get_weather"]
    else:
        jsonschema.validate(json.loads(result.content), VERDICT)


def test_a_forced_choice_beside_a_schema_is_a_call(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_union_request(tool_choice="required")).result()
    assert [c.name for c in result.tool_calls] == ["get_weather"]


def test_tool_choice_none_leaves_the_schema_alone(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_union_request(_token(tiny_engine, "<tool_call>"),
                                               tool_choice="none")).result()
    assert not result.tool_calls
    jsonschema.validate(json.loads(result.content), VERDICT)


def test_a_bad_tool_schema_beside_a_schema_is_refused_at_submit(tiny_engine: Engine) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}
    with pytest.raises(InvalidConstraintError):
        tiny_engine.submit(ChatRequest.from_openai(
            ASK, greedy(8, constraint=JsonSchema(VERDICT)), tools=[bad]))


def test_a_greedy_array_of_choices_ends_instead_of_repeating(tiny_engine: Engine) -> None:
    # Closing the array made the unlikeliest move: unbounded, the items go on to max_tokens.
    schema = {"type": "object", "properties": {"tools": {"type": "array", "items": {
        "anyOf": [{"const": "translate"}, {"const": "search"}]}}}, "required": ["tools"]}
    vocab = tiny_engine.tokenizer.get_vocab()
    closing = mx.array([tid for text, tid in vocab.items() if "]" in text])
    params = greedy(200, constraint=JsonSchema(schema), logits_processors=(
        lambda tokens, logits: logits.at[..., closing].add(-1e4),))
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, params)).result()
    assert result.finish_reason is FinishReason.STOP, result.text
    assert len(json.loads(result.content)["tools"]) <= 2


# ----- the repeat guard: a call the history answered is not admitted again -------------

PARIS_ANSWERED: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]


def _steered(eng: Engine, text: str) -> Callable[[Any, Any], Any]:
    """A logits processor that makes greedy write ``text``, as far as the grammar lets it:
    each step favours the token that continues ``text`` from what was written (read from
    the tokens, as the grammar may write some itself); once the row leaves ``text``
    (where the grammar refused its next token), it writes freely."""
    tokenizer = eng.tokenizer
    prompt_len: list[int] = []

    def process(tokens: Any, logits: Any) -> Any:
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if not prompt_len:
            prompt_len.append(len(ids))
        written = tokenizer.decode(ids[prompt_len[0]:])
        if not text.startswith(written) or written == text:
            return logits
        following = tokenizer.encode(text[len(written):], add_special_tokens=False)[0]
        return logits + mx.zeros(logits.shape[-1]).at[following].add(1e4)

    return process


def _call(city: str) -> str:
    return ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city
            + '"}}\n</tool_call>')


def _steered_request(eng: Engine, messages: list[dict[str, Any]], text: str,
                     **kw: Any) -> ChatRequest:
    params = greedy(96, constraint=JsonSchema(VERDICT), logits_processors=(
        _steered(eng, text),), repeat_answered_calls=kw.pop("repeat", False))
    return ChatRequest.from_openai(messages, params, tools=[WEATHER],
                                   parallel_tool_calls=False, **kw)


def _cities(result: Any) -> list[str]:
    return [c.arguments.get("city") for c in result.tool_calls]


def test_an_answered_call_is_not_admitted_again(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_steered_request(tiny_engine, PARIS_ANSWERED,
                                                 _call("Paris"))).result()
    assert "Paris" not in _cities(result), result.text
    if not result.tool_calls:  # the row answered instead: the schema's JSON
        jsonschema.validate(json.loads(result.content), VERDICT)


def test_a_call_with_other_arguments_is_still_admitted(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_steered_request(tiny_engine, PARIS_ANSWERED,
                                                 _call("Lyon"))).result()
    assert _cities(result) == ["Lyon"], result.text


@pytest.mark.parametrize("case", ["repeat_answered_calls", "required", "no history",
                                  "no result yet"])
def test_the_guard_leaves_these_requests_alone(tiny_engine: Engine, case: str) -> None:
    messages: list[dict[str, Any]] = {"no history": ASK,
                                      "no result yet": PARIS_ANSWERED[:-1]}.get(
        case, PARIS_ANSWERED)
    kw: dict[str, Any] = {"repeat": case == "repeat_answered_calls"}
    if case == "required":
        kw["tool_choice"] = "required"
    if case == "no result yet":  # a call waiting for its result: not answered
        messages = [*messages, {"role": "tool", "tool_call_id": "other", "content": "?"}]
    result = tiny_engine.submit(_steered_request(tiny_engine, messages, _call("Paris"),
                                                 **kw)).result()
    assert _cities(result) == ["Paris"], result.text


# ----- the per-tool call limit: a tool called that many times is no longer offered -----

TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# Every value bounded both ways: steered off its call, the row's answer must end.
SHORT_VERDICT = {**VERDICT, "properties": {**VERDICT["properties"], "degrees": {
    "type": "integer", "minimum": -50, "maximum": 50}}}


def _limited(eng: Engine, text: str, limit: int | None, **kw: Any) -> ChatRequest:
    params = greedy(96, constraint=kw.pop("constraint", JsonSchema(SHORT_VERDICT)),
                    logits_processors=(_steered(eng, text),), tool_call_limit=limit)
    return ChatRequest.from_openai(kw.pop("messages", PARIS_ANSWERED), params,
                                   tools=kw.pop("tools", [WEATHER]),
                                   parallel_tool_calls=False, **kw)


def test_a_tool_at_its_call_limit_leaves_the_union(tiny_engine: Engine) -> None:
    # Steered to call get_weather for another city (which the repeat guard admits), the
    # row can only answer: the tool was called once and the limit is one.
    result = tiny_engine.submit(_limited(tiny_engine, _call("Lyon"), 1)).result()
    assert (result.tool_calls, result.finish_reason) == ((), FinishReason.STOP), result.text
    jsonschema.validate(json.loads(result.content), SHORT_VERDICT)


def test_below_its_call_limit_a_tool_is_still_offered(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_limited(tiny_engine, _call("Lyon"), 2)).result()
    assert _cities(result) == ["Lyon"], result.text


def test_a_required_call_goes_to_a_tool_below_its_limit(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_limited(tiny_engine, _call("Lyon"), 1, constraint=None,
                                         tools=[WEATHER, TIME],
                                         tool_choice="required")).result()
    assert [c.name for c in result.tool_calls] == ["get_time"], result.text


def test_a_named_tool_is_called_whatever_its_limit(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(_limited(tiny_engine, _call("Lyon"), 1, constraint=None,
                                         tool_choice="get_weather")).result()
    assert _cities(result) == ["Lyon"], result.text


def test_a_required_call_with_every_tool_at_its_limit_is_refused_at_submit(
        tiny_engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="tool_call_limit=1") as refused:
        tiny_engine.submit(_limited(tiny_engine, _call("Lyon"), 1, constraint=None,
                                    tool_choice="required"))
    assert refused.value.field == "tool_call_limit"
