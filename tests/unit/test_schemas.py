"""Strict schemas without a model: strict_schema on hand-written and pydantic schemas,
checked by jsonschema and by llguidance over a byte-level tokenizer (no mlx)."""

from __future__ import annotations

import copy
import json
from types import MappingProxyType
from typing import Any, Literal

import jsonschema
import llguidance
import pytest
from pydantic import BaseModel, Field, TypeAdapter
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from engine.errors import InvalidConstraintError
from engine.requests.constraints.forced_calls import forced_call_grammar, forced_call_schema
from engine.requests.constraints.grammar import grammar_text, validate_constraint
from engine.requests.constraints.schemas import rebase_refs, strict_schema
from engine.requests.inbound.output_constraint import JsonObject, JsonSchema
from engine.requests.inbound.tool_specs import normalize_tools

CLOSED: dict[str, Any] = {"additionalProperties": False}


def obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **extra}


def valid(schema: dict[str, Any], instance: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def open_object_levels(node: Any, path: str = "#") -> list[str]:
    """Paths of object schemas left without additionalProperties (a rough, test-only walk)."""
    found: list[str] = []
    if isinstance(node, dict):
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
            kind is None and isinstance(node.get("properties"), dict))
        if is_object and "additionalProperties" not in node:
            found.append(path)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples", "not", "if"):
                found += open_object_levels(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += open_object_levels(value, f"{path}/{index}")
    return found


# --- hand-written schemas -------------------------------------------------------------

NESTED = obj({
    "name": {"type": "string"},
    "address": obj({"city": {"type": "string"},
                    "geo": obj({"lat": {"type": "number"}, "lon": {"type": "number"}})}),
    "tags": {"type": "array", "items": obj({"label": {"type": "string"}})},
}, required=["name", "address"])


def test_every_nested_object_is_closed_and_key_order_is_kept() -> None:
    strict = strict_schema(NESTED)
    assert strict["additionalProperties"] is False
    address = strict["properties"]["address"]
    assert address["additionalProperties"] is False
    assert address["properties"]["geo"]["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["name"]  # only objects
    assert "additionalProperties" not in strict["properties"]["tags"]  # an array
    # the same keys in the same order, additionalProperties appended last
    assert list(strict) == [*NESTED, "additionalProperties"]
    assert list(strict["properties"]) == ["name", "address", "tags"]
    assert list(address["properties"]) == ["city", "geo"]
    assert list(address) == ["type", "properties", "additionalProperties"]
    assert open_object_levels(strict) == []


def test_undeclared_keys_are_refused_at_every_level_by_a_validator() -> None:
    strict = strict_schema(NESTED)
    good = {"name": "a", "address": {"city": "b", "geo": {"lat": 1, "lon": 2}},
            "tags": [{"label": "x"}]}
    assert valid(NESTED, good) and valid(strict, good)
    for extra in ({**good, "x": 1},
                  {**good, "address": {"city": "b", "zip": "1"}},
                  {**good, "address": {"city": "b", "geo": {"lat": 1, "alt": 3}}},
                  {**good, "tags": [{"label": "x", "color": "red"}]}):
        assert valid(NESTED, extra) and not valid(strict, extra), extra


def test_input_is_not_mutated_and_any_mapping_works() -> None:
    before = copy.deepcopy(NESTED)
    strict = strict_schema(NESTED)
    assert before == NESTED
    strict["properties"]["address"]["properties"]["city"]["maxLength"] = 3
    assert before == NESTED  # a deep copy: nothing shared
    proxy = MappingProxyType({"type": "object", "properties": MappingProxyType(
        {"a": {"enum": ("x", "y")}})})
    assert strict_schema(proxy) == {"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                    **CLOSED}


def test_what_counts_as_an_object() -> None:
    assert strict_schema({"type": "object"}) == {"type": "object", **CLOSED}
    assert strict_schema({"properties": {"a": {}}}) == {"properties": {"a": {}}, **CLOSED}
    nullable = {"type": ["object", "null"], "properties": {"a": {}}}
    assert strict_schema(nullable) == {**nullable, **CLOSED}
    for not_object in ({"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                       {"enum": [{"type": "object"}]}, {"const": {"properties": {}}},
                       {"default": {"type": "object"}}, {}, {"required": ["a"]}):
        assert strict_schema(not_object) == not_object


def test_defs_and_refs() -> None:
    for defs in ("$defs", "definitions"):
        schema = {"type": "object", "properties": {
            "home": {"$ref": f"#/{defs}/Address"},
            "work": {"$ref": f"#/{defs}/Address", "description": "office"}},
            defs: {"Address": obj({"city": {"type": "string"}, "geo": {"$ref": f"#/{defs}/Geo"}}),
                   "Geo": obj({"lat": {"type": "number"}})}}
        strict = strict_schema(schema)
        assert strict[defs]["Address"]["additionalProperties"] is False
        assert strict[defs]["Geo"]["additionalProperties"] is False
        assert strict["properties"]["home"] == {"$ref": f"#/{defs}/Address"}
        assert open_object_levels(strict) == []
        good = {"home": {"city": "a", "geo": {"lat": 1}}}
        assert valid(strict, good)
        assert not valid(strict, {"home": {"city": "a", "geo": {"lat": 1, "x": 0}}})
        assert not valid(strict, {"work": {"city": "a", "zip": "1"}})


def test_recursive_refs() -> None:
    children = {"type": "array", "items": {"$ref": "#/$defs/Node"}}
    tree = {"$defs": {"Node": obj({"value": {"type": "string"}, "children": children})},
            "$ref": "#/$defs/Node"}
    strict = strict_schema(tree)
    assert strict["$defs"]["Node"]["additionalProperties"] is False
    assert valid(strict, {"value": "a", "children": [{"value": "b", "children": []}]})
    assert not valid(strict, {"value": "a", "children": [{"value": "b", "extra": 1}]})
    root_ref = obj({"name": {"type": "string"}, "child": {"$ref": "#"}})
    assert not valid(strict_schema(root_ref), {"name": "a", "child": {"name": "b", "x": 1}})


def test_arrays_of_objects() -> None:
    schema = obj({
        "items": {"type": "array", "items": obj({"a": {}})},
        "tuple": {"type": "array", "prefixItems": [obj({"b": {}}), {"type": "string"}],
                  "items": obj({"c": {}})},
        "draft7": {"type": "array", "items": [obj({"d": {}})], "additionalItems": obj({"e": {}})},
        "contains": {"type": "array", "contains": obj({"f": {}})},
    })
    strict = strict_schema(schema)
    props = strict["properties"]
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["tuple"]["prefixItems"][0]["additionalProperties"] is False
    assert props["tuple"]["prefixItems"][1] == {"type": "string"}
    assert props["tuple"]["items"]["additionalProperties"] is False
    assert props["draft7"]["items"][0]["additionalProperties"] is False
    assert props["draft7"]["additionalItems"]["additionalProperties"] is False
    assert props["contains"]["contains"]["additionalProperties"] is False
    assert open_object_levels(strict) == []


def test_branches_of_anyof_oneof_allof_and_then_else() -> None:
    schema = obj({
        "any": {"anyOf": [obj({"a": {}}), {"type": "null"}]},
        "one": {"oneOf": [obj({"b": {}}), obj({"c": {}})]},
        "all": {"allOf": [obj({"d": {}})], "description": "one part: nothing to merge"},
        "cond": {"if": {"type": "string"}, "then": {"maxLength": 3},
                 "else": {"type": "object", "properties": {"e": {}}}},
    })
    strict = strict_schema(schema)
    props = strict["properties"]
    assert props["any"]["anyOf"][0]["additionalProperties"] is False
    assert props["any"]["anyOf"][1] == {"type": "null"}
    assert [b["additionalProperties"] for b in props["one"]["oneOf"]] == [False, False]
    assert props["all"]["allOf"][0]["additionalProperties"] is False
    assert props["cond"]["else"]["additionalProperties"] is False
    assert open_object_levels(strict) == []
    assert not valid(strict, {"any": {"a": 1, "z": 2}})
    assert valid(strict, {"any": None, "one": {"c": 1}, "cond": {"e": 1}})
    assert not valid(strict, {"cond": {"e": 1, "z": 2}})


def test_a_level_that_states_additional_properties_is_left_as_written() -> None:
    inner = obj({"x": {}})
    for stated in (True, False, {"type": "integer"}, inner):
        schema = obj({"free": obj({"deep": obj({"y": {}})}, additionalProperties=stated)},
                     additionalProperties=stated)
        strict = strict_schema(schema)
        # as written, except that an object given as the values' schema is itself closed
        assert strict["additionalProperties"] == (
            {**inner, **CLOSED} if stated is inner else stated)
        free = strict["properties"]["free"]
        assert list(free) == ["type", "properties", "additionalProperties"]
        # objects nested inside a level the user left open are still closed
        assert free["properties"]["deep"]["additionalProperties"] is False
    # additionalProperties given as a schema: the objects it describes are closed
    strict = strict_schema(obj({}, additionalProperties=inner))
    assert strict["additionalProperties"] == {**inner, **CLOSED}
    assert valid(strict, {"k": {"x": 1}}) and not valid(strict, {"k": {"x": 1, "q": 2}})
    # unevaluatedProperties is also the user's own choice for that level
    stated_late = obj({"a": {}}, unevaluatedProperties=False)
    assert strict_schema(stated_late) == stated_late


def test_opt_out_with_additional_properties_true() -> None:
    schema = obj({"meta": obj({"id": {}}, additionalProperties=True)})
    strict = strict_schema(schema)
    assert valid(strict, {"meta": {"id": 1, "anything": 2}})
    assert not valid(strict, {"meta": {"id": 1}, "other": 2})


def test_not_and_if_are_conditions_and_left_alone() -> None:
    # Closing inside a condition loosens: {"a": 1, "b": 2} would no longer be "not" it.
    schema = {"type": "object", "not": obj({"a": {"const": 1}}, required=["a"]),
              "if": obj({"kind": {"const": "x"}}), "then": {"required": ["x"]}}
    strict = strict_schema(schema)
    assert strict["not"] == schema["not"] and strict["if"] == schema["if"]
    assert not valid(strict, {"a": 1, "b": 2})


def test_keys_split_across_allof_parts_stay_open_at_that_level() -> None:
    # additionalProperties sees only its own level's properties: closing either part (or
    # the holder) would refuse keys the other declares, so the merged level stays open.
    split = obj({"a": {}}, allOf=[{"properties": {"b": obj({"c": {}})}}])
    strict = strict_schema(split)
    assert "additionalProperties" not in strict
    assert "additionalProperties" not in strict["allOf"][0]
    assert strict["allOf"][0]["properties"]["b"]["additionalProperties"] is False
    assert valid(strict, {"a": 1, "b": {"c": 2}})
    assert not valid(strict, {"a": 1, "b": {"c": 2, "d": 3}})

    parts = {"allOf": [{"$ref": "#/$defs/Base"}, obj({"extra": {}})],
             "$defs": {"Base": obj({"base": {}}), "Other": obj({"o": {}})}}
    strict = strict_schema(parts)
    assert "additionalProperties" not in strict["$defs"]["Base"]
    assert "additionalProperties" not in strict["allOf"][1]
    assert strict["$defs"]["Other"]["additionalProperties"] is False
    assert valid(strict, {"base": 1, "extra": 2})

    branches = obj({"kind": {"enum": ["a", "b"]}},
                   anyOf=[{"properties": {"a": {}}}, {"properties": {"b": {}}}])
    assert valid(strict_schema(branches), {"kind": "a", "a": 1})


def test_branches_that_only_require_keys_do_not_open_a_level() -> None:
    schema = obj({"a": {}, "b": {}}, anyOf=[{"required": ["a"]}, {"required": ["b"]}])
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert valid(strict, {"a": 1}) and not valid(strict, {"a": 1, "z": 0})


def test_strict_schema_is_idempotent() -> None:
    for schema in (NESTED, obj({"a": {}}, allOf=[{"properties": {"b": {}}}]),
                   {"$ref": "#/$defs/A", "$defs": {"A": obj({"a": obj({})})}}):
        once = strict_schema(schema)
        assert strict_schema(once) == once


def test_rebase_refs() -> None:
    schema = {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/A"}, "b": {"not": {"$ref": "#"}},
        "c": {"$ref": "https://example.com/x.json"}, "d": {"const": {"$ref": "#/keep"}}},
        "$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"}}}}
    moved = rebase_refs(schema, "#/anyOf/0/properties/arguments")
    props = moved["properties"]
    assert props["a"] == {"$ref": "#/anyOf/0/properties/arguments/$defs/A"}
    assert props["b"] == {"not": {"$ref": "#/anyOf/0/properties/arguments"}}
    assert props["c"] == schema["properties"]["c"] and props["d"] == schema["properties"]["d"]
    assert moved["$defs"]["A"]["items"]["$ref"] == "#/anyOf/0/properties/arguments/$defs/A"
    assert schema["properties"]["a"] == {"$ref": "#/$defs/A"}  # not mutated


# --- schemas from pydantic -------------------------------------------------------------

class Geo(BaseModel):
    lat: float
    lon: float


class Address(BaseModel):
    city: str = Field(max_length=20)
    geo: Geo | None = None


class Person(BaseModel):
    name: str
    address: Address
    previous: list[Address] = []
    kind: Literal["a", "b"] = "a"
    labels: dict[str, str] = {}


class Movie(TypedDict):
    title: str
    cast: list[Geo]


def test_pydantic_models_are_closed_everywhere() -> None:
    schema = Person.model_json_schema()
    strict = strict_schema(schema)
    assert open_object_levels(strict) == []
    assert strict["properties"]["labels"] == schema["properties"]["labels"]  # a dict: stated
    assert list(strict["properties"]) == list(schema["properties"])
    good = Person(name="n", address=Address(city="c", geo=Geo(lat=1, lon=2)),
                  previous=[Address(city="d")], labels={"k": "v"}).model_dump(mode="json")
    assert valid(strict, good)
    assert valid(strict, {**good, "labels": {"any": "key"}})
    for bad in ({**good, "age": 3},
                {**good, "address": {**good["address"], "zip": "1"}},
                {**good, "address": {"city": "c", "geo": {"lat": 1, "lon": 2, "alt": 3}}},
                {**good, "previous": [{"city": "d", "country": "x"}]}):
        assert valid(schema, bad) and not valid(strict, bad), bad


def test_typed_dict_schema_is_closed() -> None:
    schema = TypeAdapter(Movie).json_schema()
    strict = strict_schema(schema)
    assert open_object_levels(strict) == []
    assert valid(strict, {"title": "t", "cast": [{"lat": 1, "lon": 2}]})
    assert not valid(strict, {"title": "t", "cast": [{"lat": 1, "lon": 2, "x": 0}]})


# --- llguidance: the grammar refuses what the strict schema refuses ----------------------

class _ByteTokenizer:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), slices=[])


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar admits exactly ``text``, byte by byte."""
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return bool(matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting())


def compact(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def test_json_schema_grammar_refuses_undeclared_nested_keys(byte_tokenizer: Any) -> None:
    schema = Person.model_json_schema()
    grammar = grammar_text(JsonSchema(schema))
    good = {"name": "n", "address": {"city": "c", "geo": {"lat": 1, "lon": 2}}}
    assert accepts(byte_tokenizer, grammar, compact(good))
    assert not accepts(byte_tokenizer, grammar, compact({**good, "age": 1}))
    assert not accepts(byte_tokenizer, grammar,
                       compact({**good, "address": {"city": "c", "zip": "1"}}))
    assert not accepts(byte_tokenizer, grammar, compact(
        {**good, "address": {"city": "c", "geo": {"lat": 1, "lon": 2, "alt": 3}}}))
    opted_out = grammar_text(JsonSchema(obj({"meta": obj({"id": {"type": "integer"}},
                                                         additionalProperties=True)})))
    assert accepts(byte_tokenizer, opted_out, compact({"meta": {"id": 1, "other": 2}}))
    assert not accepts(byte_tokenizer, opted_out, compact({"meta": {"id": 1}, "other": 2}))
    # JsonObject stays "any object"
    assert accepts(byte_tokenizer, grammar_text(JsonObject()), compact({"x": {"y": 1}}))


def test_forced_call_arguments_are_closed_at_every_level(byte_tokenizer: Any) -> None:
    tools = normalize_tools([
        {"type": "function", "function": {"name": "visit", "parameters":
                                          Person.model_json_schema()}},
        {"type": "function", "function": {"name": "move", "parameters": obj(
            {"to": obj({"city": {"type": "string"}})}, required=["to"])}},
    ])
    before = copy.deepcopy(tools[0].parameters)
    schema = forced_call_schema(tools, "required")
    assert tools[0].parameters == before
    arguments = [branch["properties"]["arguments"] for branch in schema["anyOf"]]
    assert [open_object_levels(a) for a in arguments] == [[], []]
    # pydantic's $defs now sit under the arguments: the refs must follow them
    assert arguments[0]["properties"]["address"]["$ref"] == (
        "#/anyOf/0/properties/arguments/$defs/Address")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    visit = {"name": "visit", "arguments": {"name": "n", "address": {"city": "c"}}}
    move = {"name": "move", "arguments": {"to": {"city": "Paris"}}}
    assert accepts(byte_tokenizer, grammar, compact(visit))
    assert accepts(byte_tokenizer, grammar, compact(move))
    assert not accepts(byte_tokenizer, grammar,
                       compact({**move, "arguments": {"to": {"city": "P", "zip": "1"}}}))
    assert not accepts(byte_tokenizer, grammar, compact(
        {**visit, "arguments": {"name": "n", "address": {"city": "c", "zip": "1"}}}))
    lark = forced_call_grammar(tools, "visit", parallel=False).grammar
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark)) \
        == ""
    validate_constraint(JsonSchema(schema))  # what submit checks


# --- JsonSchema refuses what is not a schema object ------------------------------------

@pytest.mark.parametrize(("schema", "expected"), [
    ("5", "got a JSON number"), ("[1, 2]", "got a JSON array"), ("null", "got a JSON null"),
    ('"text"', "got a JSON string"), ("{oops", "not valid JSON"),
    (5, "got int"), (None, "got NoneType"), ([{"type": "object"}], "got list"),
    ({"type": "object", "default": object()}, "not JSON"),
])
def test_json_schema_refuses_non_objects(schema: Any, expected: str) -> None:
    with pytest.raises(InvalidConstraintError, match=expected) as caught:
        JsonSchema(schema)
    assert isinstance(caught.value, ValueError)
    assert "must be a dict or the JSON text" in str(caught.value) or "JSON" in str(caught.value)


def test_json_schema_keeps_the_users_text_and_order() -> None:
    assert JsonSchema(NESTED).schema_dict == NESTED
    assert list(JsonSchema(json.dumps(NESTED)).schema_dict["properties"]) == [
        "name", "address", "tags"]
    assert JsonSchema(MappingProxyType({"type": "object"})).schema_dict == {"type": "object"}
