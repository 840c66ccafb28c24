"""A thinking budget as grammar: at most N reasoning tokens, then the answer's constraint.

A prompt that opens a reasoning block (a thinking model's template) lets the model think
until it closes the block itself, which a small or quantized model may never do before
``max_tokens`` (then the answer is empty). With ``reasoning_budget`` N the row's grammar is
``start: thinking CLOSE AFTER answer`` where ``thinking`` is free text of at most N tokens
(llguidance's ``max_tokens`` on a rule): the model may close the block sooner; at N the
grammar allows nothing but the close. ``answer`` is the request's own constraint (JSON,
a forced call, tools or a schema) or free text. A regex or a Lark grammar of the caller's
is taken alone, as written (it cannot be embedded). No mlx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.requests.constraints.grammar import json_answer_schema
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
)


@dataclass(frozen=True)
class ReasoningPrefix:
    """Lark for what comes before the answer: ``start`` goes first in the start rule,
    ``rules`` (definitions it uses) are appended to the grammar."""

    start: str = ""
    rules: str = ""


def reasoning_prefix(close: str, after: str, budget: int | None) -> ReasoningPrefix:
    """Close the reasoning block (``close``, ``after``: Lark), at once when ``budget`` is
    None or 0, else after at most ``budget`` tokens of reasoning text."""
    if not budget:
        return ReasoningPrefix(f"{close} {after}")
    return ReasoningPrefix(f"thinking {close} {after}",
                           f"thinking[max_tokens={budget}]: /(?s:.*)/\n")


def budget_joins(constraint: Constraint | None) -> bool:
    """Whether a budget can go before this constraint's answer (None, JSON)."""
    return constraint is None or isinstance(constraint, JsonSchema | JsonObject)


def budgeted_answer(constraint: Constraint | None, prefix: ReasoningPrefix) -> LarkGrammar:
    """The whole grammar: the reasoning prefix, then JSON for the constraint or any text."""
    if isinstance(constraint, JsonSchema | JsonObject):
        answer = f"answer: %json {json.dumps(json_answer_schema(constraint))}\n"
    else:
        answer = "answer: /(?s:.*)/\n"
    return LarkGrammar(f"start: {prefix.start} answer\n{answer}{prefix.rules}")
