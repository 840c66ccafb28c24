"""The dialect registry collects the families itself, in their declared priority (no model).

Detection checks families highest priority first; the order below is the one every family
test relies on (a family whose marks another's include comes first). The declarations the
rest of the engine reads (reasoning tokens, tool formats) come from the same classes.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from engine.requests.dialects.dialect import Dialect, TokenizerFacts
from engine.requests.dialects.registry import (
    FAMILIES,
    collect_families,
    dialect_for,
    reasoning_tokens,
)
from engine.requests.inbound.tool_prompts import SMOLLM2

# The order the registry's hand-written tuple had: detection stays the same for each family
# (a new family may go anywhere among them).
FORMER_ORDER = ["harmony", "mistral", "deepseek-r1", "qwen-xml", "gemma4", "pythonic",
                "llama3-json"]


def test_every_family_module_is_collected_in_priority_order() -> None:
    names = [family.name for family in FAMILIES]
    assert [name for name in names if name in FORMER_ORDER] == FORMER_ORDER
    priorities = [family.priority for family in FAMILIES]
    assert priorities == sorted(priorities, reverse=True) and min(priorities) > 0


def _module(name: str, *classes: type[Dialect]) -> ModuleType:
    module = ModuleType(name)
    for cls in classes:
        cls.__module__ = name
        setattr(module, cls.__name__, cls)
    return module


def test_a_new_module_is_a_new_family_and_shared_bases_are_not() -> None:
    class Early(Dialect):
        name, priority = "early", 100

    class Late(Dialect):
        name, priority = "late", 5

    class SharedBase(Dialect):  # priority 0: a base for families, never checked itself
        name = "shared"

    found = collect_families([_module("fam_a", Late, SharedBase), _module("fam_b", Early)])
    assert found == (Early, Late)
    imported = _module("fam_c")
    imported.Early = Early  # type: ignore[attr-defined]  # imported, not defined, here
    assert collect_families([imported]) == ()


def test_two_families_may_not_share_a_priority_or_a_name() -> None:
    class One(Dialect):
        name, priority = "one", 7

    class Two(Dialect):
        name, priority = "two", 7

    with pytest.raises(ValueError, match="share the priority 7"):
        collect_families([_module("tie", One, Two)])

    class Same(Dialect):
        name, priority = "one", 8

    with pytest.raises(ValueError, match="share the name 'one'"):
        collect_families([_module("same", One, Same)])


def test_a_tokenizer_without_family_marks_speaks_the_default() -> None:
    assert type(dialect_for(TokenizerFacts())) is Dialect


def test_the_declared_reasoning_tokens_are_mlx_lms_and_the_families() -> None:
    assert set(reasoning_tokens()) == {
        ("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
        ("<|think:start|>", "<|think:end|>"), ("<|channel>", "<channel|>"),
        ("<|channel|>", "<|message|>")}
    assert len(reasoning_tokens()) == len(set(reasoning_tokens()))


def test_the_default_dialect_declares_smollm2s_tool_prompt() -> None:
    assert SMOLLM2 in Dialect.tool_formats
