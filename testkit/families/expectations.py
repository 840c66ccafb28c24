"""What the family tests expect of one family, on its real tokenizer and template.

Each ``Family`` of the catalog carries one ``Expected``: what mlx-lm infers from its
tokenizer, what its published template cannot render, the dialect the engine picks, one
``get_weather(city="Paris")`` call as the family writes it, how it ends a turn, how it
reasons. Every test of ``tests/families`` reads these, so a new family is one catalog row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# One get_weather(city="Paris") call in tagged JSON: the default dialect's form (Qwen3's
# and Granite 4's templates write it; the fallback tool prompt asks for it).
TAGGED_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               "</tool_call>")


@dataclass(frozen=True)
class Reasoning:
    """How a family reasons then answers, written after its prompt."""

    opener: str  # what the model writes to open reasoning where the prompt has not
    between: str  # what it writes after the reasoning, before the answer
    # The template switches that turn thinking on.
    switches: Mapping[str, Any] = field(default_factory=lambda: {"enable_thinking": True})

    def turn(self, thought: str, answer: str, *, opened: bool) -> str:
        """``thought`` then ``answer`` as the model writes them; ``opened``: the prompt
        already opened the reasoning block."""
        return ("" if opened else self.opener) + thought + self.between + answer


@dataclass(frozen=True)
class Expected:
    """One family's expectations (see the module docstring)."""

    dialect: str  # the name of the dialect its tokenizer picks (``Dialect.name``)
    end_of_turn: str  # the token that ends an answer turn (a stop token)
    # One get_weather(city="Paris") call as the family writes it and its forced grammar
    # accepts (as its template renders a call, or as documented where it renders none).
    native_call: str
    tool_parser: str | None = None  # the tool parser mlx-lm infers, by module name
    think_start: str | None = None  # the thinking start mlx-lm infers
    # What the template does not render, of "tools" (passed as tools=), "xml_tools",
    # "call" (an assistant's tool_calls) and "result" (a tool message): "dropped" or
    # "raises", with why after a space. Anything not listed is rendered.
    cannot_render: Mapping[str, str] = field(default_factory=dict)
    # The call as the model writes it unforced after its generation prompt, and as its
    # template renders one, where that differs from ``native_call``.
    unforced_call: str | None = None
    # How the engine's second-turn prompt shows the past call where the template renders
    # none and the engine writes it as text (default: as the model writes it).
    history_call: str | None = None
    end_of_call: str | None = None  # what ends a call turn, where not ``end_of_turn``
    reasoning: Reasoning | None = None  # None: the family does not reason
    refuses_system: bool = False  # the template raises on a system message
    reference_texts: int = 0  # texts its tokenizer is checked on against the reference
    # The fitted tests fit this family (slow: every dialect has at least one such family).
    fitted: bool = False

    @property
    def call_written(self) -> str:
        """The call as the model writes it unforced."""
        return self.unforced_call or self.native_call

    @property
    def template_call(self) -> str | None:
        """The call as the template renders it in a history; None where it renders none."""
        return None if "call" in self.cannot_render else self.call_written

    @property
    def past_call(self) -> str:
        """The past call as the engine's second-turn prompt shows it."""
        return self.template_call or self.history_call or self.native_call

    @property
    def call_ends_with(self) -> str:
        return self.end_of_call or self.end_of_turn
