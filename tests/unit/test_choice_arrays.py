"""Arrays of finite choices are bounded to one item per choice (the JSON-item loop guard)."""

from __future__ import annotations

from engine.requests.constraints.choice_arrays import bound_choice_arrays

SELECTION = {"type": "object", "properties": {"tools": {"type": "array", "items": {"anyOf": [
    {"const": "translate", "type": "string"}, {"const": "search", "type": "string"}]}}}}


def test_an_array_of_choices_gets_one_item_per_choice() -> None:
    bounded = bound_choice_arrays(SELECTION)
    assert bounded["properties"]["tools"]["maxItems"] == 2
    colours = bound_choice_arrays({"type": "array", "items": {"enum": ["r", "g", "b"]},
                                   "uniqueItems": True})
    assert colours["maxItems"] == 3


def test_a_stated_bound_and_open_items_are_kept() -> None:
    assert bound_choice_arrays({"type": "array", "items": {"enum": ["a"]},
                                "maxItems": 5})["maxItems"] == 5
    assert bound_choice_arrays({"type": "array", "items": {"enum": ["a"]},
                                "minItems": 3})["maxItems"] == 3
    assert "maxItems" not in bound_choice_arrays({"type": "array", "items": {"type": "string"}})
    mixed = {"type": "array", "items": {"anyOf": [{"const": "a"}, {"type": "string"}]}}
    assert "maxItems" not in bound_choice_arrays(mixed)
