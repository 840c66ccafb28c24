"""The grammar of "call a tool or answer": one request, either reply.

A request with tools (``tool_choice`` "auto") and a JSON output constraint (an agent's
final schema) may end its turn two ways: a call, so the agent runs the tool and asks
again, or the answer, JSON valid for the schema. A grammar for the schema alone would
shut the tools off; one for the calls alone would never let the agent finish. This is
their union: ``start: prefix (calls | answer)``, where ``calls`` is the model family's own
forced-call rule (the dialect writes it) and ``answer`` the schema's JSON (free text when a
reasoning budget shapes a turn with tools and no schema), after the family's answer header
where it has one. No mlx.
"""

from __future__ import annotations

from engine.requests.constraints.reasoning_budget import answer_rule
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
)


def joins_tools(constraint: Constraint | None) -> bool:
    """Whether a constraint can share a turn with tool calls: JSON ones can (their answer
    is a ``%json`` rule of the union); a user's regex or Lark grammar is taken as written,
    alone, since it cannot be embedded beside the calls without rewriting it."""
    return isinstance(constraint, JsonSchema | JsonObject)


def tools_or_answer_grammar(calls: str, answer: JsonSchema | JsonObject | None,
                            prefix: str = "", head: str = "") -> LarkGrammar:
    """The union grammar around a dialect's ``calls`` rule (Lark text defining ``calls``).

    ``prefix`` (Lark) comes before either branch, e.g. the close of a reasoning block the
    prompt opened; ``head`` before the answer (``answer_rule``). As in a forced grammar, a
    newline may follow the last call (models write one and it must not force another)."""
    lead = f"{prefix} " if prefix else ""
    return LarkGrammar(f'start: {lead}(calls "\\n"? | answer)\n'
                       f"{answer_rule(answer, head)}{calls}")
