"""The repeat guard's argument schemas refuse exactly the answered calls (jsonschema as the
judge: its regexes read the guard's string patterns as llguidance does)."""

from __future__ import annotations

import itertools
from typing import Any

import jsonschema

from engine.requests.constraints.answered_calls import (
    answered_arguments,
    excluding,
    unanswered_tools,
    within_limit,
)
from engine.requests.inbound.messages import messages_from_openai
from engine.requests.inbound.tool_specs import normalize_tools

PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "unit": {"enum": ["C", "F"]},
    "scale": {"type": "number"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}},
              "required": ["lat"]}}, "required": ["city"], "additionalProperties": False}
ABSENT = object()
CANDIDATES = {"city": [ABSENT, "Paris", "Pari", "Parisx", "Lyon", "", "P\u00e9"],
              "days": [ABSENT, 1, 3, 4, 7], "metric": [ABSENT, True, False],
              "unit": [ABSENT, "C", "F"], "scale": [ABSENT, 1, 1.5, 2.0],
              "where": [ABSENT, {"lat": 1.0}, {"lat": 2}]}


def _objects(keys: list[str]) -> list[dict[str, Any]]:
    """Every combination of candidate values for ``keys`` (the others left out)."""
    out = []
    for values in itertools.product(*(CANDIDATES[k] for k in keys)):
        out.append({k: v for k, v in zip(keys, values, strict=True) if v is not ABSENT})
    return out


def _valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _refuses_exactly(answered: list[dict[str, Any]], keys: list[str]) -> None:
    guarded = excluding(PARAMETERS, answered)
    assert guarded is not None
    for candidate in _objects(keys):
        expected = _valid(PARAMETERS, candidate) and candidate not in answered
        assert _valid(guarded, candidate) == expected, (candidate, answered)


def test_one_answered_call_is_refused_and_every_other_call_admitted() -> None:
    _refuses_exactly([{"city": "Paris"}], ["city", "days", "metric"])


def test_several_answered_calls_with_optional_and_nested_arguments() -> None:
    answered = [{"city": "Paris"}, {"city": "Lyon", "days": 3},
                {"city": "Lyon", "days": 3, "metric": True},
                {"city": "Pari", "unit": "F", "scale": 1.5}]
    _refuses_exactly(answered, ["city", "days", "metric"])
    _refuses_exactly(answered, ["city", "unit", "scale"])
    _refuses_exactly([{"city": "Paris", "where": {"lat": 1.0}}, {"city": "", "scale": 2}],
                     ["city", "scale", "where"])


def test_length_bounds_stay_beside_the_guard() -> None:
    short = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
             "required": ["city"]}
    guarded = excluding(short, [{"city": "Pa"}])
    assert guarded is not None
    assert [_valid(guarded, {"city": c}) for c in ("Pa", "P", "Pari", "Paris")] == [
        False, True, True, False]


def test_equal_numbers_are_one_value() -> None:
    guarded = excluding(PARAMETERS, [{"city": "X", "scale": 2}])
    assert guarded is not None
    assert not _valid(guarded, {"city": "X", "scale": 2.0})
    assert _valid(guarded, {"city": "X", "scale": 2.5})


def test_answered_arguments_need_a_tool_result() -> None:
    messages = messages_from_openai([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"}])
    assert answered_arguments(messages) == {"get_weather": [{"city": "Paris"}]}


def test_a_tool_with_every_call_answered_is_left_out() -> None:
    clock, weather = normalize_tools([
        {"type": "function", "function": {"name": "now", "parameters": {}}},
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}])
    answered = {"now": [{}], "get_weather": [{"city": "Paris"}]}
    kept = unanswered_tools([clock, weather], answered)
    assert [t.name for t in kept] == ["get_weather"]
    assert not _valid(kept[0].parameters, {"city": "Paris"})
    # A family that writes arguments property by property keeps the schema as declared.
    assert unanswered_tools([clock, weather], answered, json_arguments=False) == (weather,)


def test_values_the_guard_cannot_state_leave_the_tool_as_it_was() -> None:
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string"}}}, "required": ["tags"]}
    assert excluding(tags, [{"tags": ["a"]}]) is None
    patterned = {"type": "object", "properties": {"city": {"type": "string",
                                                            "pattern": "^[A-Z]"}}}
    assert excluding(patterned, [{"city": "Paris"}]) is None
    (tool,) = normalize_tools([{"type": "function", "function": {
        "name": "tag", "parameters": tags}}])
    assert unanswered_tools([tool], {"tag": [{"tags": ["a"]}]}) == (tool,)


def test_a_tool_called_as_often_as_the_limit_is_left_out() -> None:
    clock, weather = normalize_tools([
        {"type": "function", "function": {"name": "now", "parameters": {}}},
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}])
    answered = {"get_weather": [{"city": "Paris"}, {"city": "Lyon"}], "now": [{}]}
    assert within_limit([clock, weather], answered, None) == (clock, weather)
    assert within_limit([clock, weather], answered, 3) == (clock, weather)
    assert within_limit([clock, weather], answered, 2) == (clock,)
    assert within_limit([clock, weather], answered, 1) == ()
    assert within_limit([clock, weather], {}, 1) == (clock, weather)



CITY_ONLY = {"type": "object", "properties": {"city": {"type": "string"}},
             "required": ["city"], "additionalProperties": False}


def test_long_answered_texts_stay_refused_in_a_pattern_llguidance_compiles() -> None:
    """The agent of issue 37 grew its argument every turn; past ~60 characters the guard's
    pattern nested deeper than llguidance's regex parser allows and the request failed.
    Runs of shared characters are now written flat: texts of hundreds of characters still
    compile, and every one stays refused while its neighbours are admitted."""
    import json

    import llguidance

    grown = ["Paris", "Paris, France, 21 C, sunny,: 21C, sunny: 22C, sunny:: 21.2C, 22.2C",
             "x" * 400, ("Paris, France, 21 C, sunny " * 12).strip()]
    schema = excluding(CITY_ONLY, [{"city": text} for text in grown])
    assert schema is not None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    for text in grown:
        assert not _valid(schema, {"city": text})
        for near in (text[:-1], text + " ", "a" + text, text[:3] + "?" + text[4:]):
            assert _valid(schema, {"city": near}), near


def test_answered_texts_too_long_for_any_pattern_leave_the_tool_unguarded() -> None:
    """Beyond what a pattern can hold the guard stays out (the tool is offered as it was):
    it never makes a request fail."""
    import random

    rng = random.Random(1)
    text = "".join(rng.choice("abc, ") for _ in range(800))
    assert excluding(CITY_ONLY, [{"city": text}]) is None
