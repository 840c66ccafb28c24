"""A thinking budget as grammar: at most N reasoning tokens, then the answer's constraint.

A prompt that opens a reasoning block (a thinking model's template) lets the model think
until it closes the block itself, which a small or quantized model may never do before
``max_tokens`` (then the answer is empty). With ``reasoning_budget`` N the row's grammar is
``start: thinking CLOSE AFTER answer`` where ``thinking`` is free text of at most N tokens
(llguidance's ``max_tokens`` on a rule): the model may close the block sooner; at N the
grammar allows nothing but the close.

A template that leaves opening the block to the model (Qwen3 without a thinking prompt,
DeepSeek-R1 variants, SmolLM3, gpt-oss's analysis message) gets an optional block instead:
``start: reasoning? answer`` with ``reasoning: OPEN thinking CLOSE AFTER``; budget 0 (or
no budget under a constraint) admits no block. The markers are single tokens that
llguidance treats as special (added tokens), so free text can never write them: the
answer cannot open a block the grammar did not count.

``answer`` is the request's own constraint (JSON, a forced call, tools or a schema, or the
caller's regex or Lark grammar embedded whole as a nested ``%lark`` grammar) or free text,
after the family's answer header where it has one (gpt-oss: its final channel). No mlx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.requests.constraints.grammar import embedded_lark, json_answer_schema
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
)

FREE_TEXT = "/(?s:.*)/"


@dataclass(frozen=True)
class ReasoningPrefix:
    """Lark for what comes before the answer: ``start`` goes first in the start rule,
    ``rules`` (definitions it uses) are appended to the grammar."""

    start: str = ""
    rules: str = ""


def reasoning_prefix(close: str, after: str, budget: int | None) -> ReasoningPrefix:
    """Close the reasoning block the prompt opened (``close``, ``after``: Lark), at once
    when ``budget`` is None or 0, else after at most ``budget`` tokens of reasoning text."""
    if not budget:
        return ReasoningPrefix(f"{close} {after}")
    return ReasoningPrefix(f"thinking {close} {after}", _thinking(budget))


def optional_reasoning(open_: str, close: str, after: str,
                       budget: int | None) -> ReasoningPrefix:
    """A reasoning block the model may open itself (``open_``, ``close``, ``after``: Lark)
    and then holds at most ``budget`` tokens of reasoning, or skip; none at all when
    ``budget`` is None or 0."""
    if not budget:
        return ReasoningPrefix()
    return ReasoningPrefix("reasoning?", f"reasoning: {open_} thinking {close} {after}\n"
                                         + _thinking(budget))


def _thinking(budget: int) -> str:
    return f"thinking[max_tokens={budget}]: {FREE_TEXT}\n"


def answer_rule(constraint: Constraint | None, head: str = "") -> str:
    """Lark defining ``answer``: ``head`` (Lark, the family's answer header, may be empty),
    then JSON for a JSON constraint, the caller's regex or Lark grammar as a nested
    grammar, or any text when there is none."""
    if isinstance(constraint, JsonSchema | JsonObject):
        body = f"%json {json.dumps(json_answer_schema(constraint))}"
    elif isinstance(constraint, Regex | LarkGrammar):
        body = f"%lark {{\n{embedded_lark(constraint)}\n}}"
    else:
        body = FREE_TEXT
    if not head:
        return f"answer: {body}\n"
    return f"answer: {head} answer_body\nanswer_body: {body}\n"


def budgeted_answer(constraint: Constraint | None, prefix: ReasoningPrefix,
                    head: str = "") -> LarkGrammar:
    """The whole grammar: the reasoning prefix, then the answer (``answer_rule``)."""
    lead = f"{prefix.start} " if prefix.start else ""
    return LarkGrammar(f"start: {lead}answer\n{answer_rule(constraint, head)}{prefix.rules}")
