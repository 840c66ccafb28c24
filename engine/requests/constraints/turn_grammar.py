"""Which grammar a chat turn gets: the policy, for one model family's dialect.

A turn's constraint is one of three, each after the reasoning prefix and in the family's
answer frame: a forced call (the tool choice requires one), the union of calls and an
answer (tools offered beside a JSON constraint, or beside free text a reasoning budget
shapes), or the answer alone. The dialect writes calls and reasoning in the family's own
syntax; ``lark_text`` (the compiler's) writes a text as Lark for this tokenizer. Both are
passed in: this module prepares nothing and compiles nothing. No mlx here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from engine.requests.constraints.answered_calls import (
    answered_arguments,
    unanswered_tools,
    within_limit,
)
from engine.requests.constraints.forced_calls import forced_grammar
from engine.requests.constraints.reasoning_budget import (
    ReasoningPrefix,
    budgeted_answer,
    optional_reasoning,
    reasoning_prefix,
)
from engine.requests.constraints.tools_or_answer import joins_tools, tools_or_answer_grammar
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.output_constraint import Constraint, JsonObject, JsonSchema
from engine.requests.inbound.tool_specs import ToolSpec

if TYPE_CHECKING:
    from engine.requests.dialects.dialect import Dialect, Literal


class TurnGrammar:
    """The constraint of each chat turn for one tokenizer's dialect."""

    def __init__(self, dialect: Dialect, lark_text: Literal) -> None:
        self.dialect = dialect
        self.lark_text = lark_text

    def constraint(self, request: ChatRequest, opens_reasoning: bool) -> Constraint | None:
        """The row's constraint: a forced call (it wins over an output constraint: the
        reply is a call), the union of calls and an answer (tools offered beside a JSON
        constraint, or beside free text when a reasoning budget shapes the turn), or the
        answer alone; each after the reasoning prefix and in the family's answer frame."""
        params = request.params
        if request.forces_call:
            return self._forced_call(request, opens_reasoning)
        budgeted_text = (params.constraint is None and params.reasoning_budget is not None
                         and self._has_reasoning(opens_reasoning))
        if request.rendered_tools and (joins_tools(params.constraint) or budgeted_text):
            return self._tools_or_answer(request, opens_reasoning)
        return self._answer_alone(params.constraint, opens_reasoning, params.reasoning_budget)

    def _forced_call(self, request: ChatRequest, opens_reasoning: bool) -> Constraint:
        """The grammar that forces tool calls in this model's own syntax. A prompt that
        opened the reasoning block has it closed first, so the call is never reasoning."""
        calls = self.dialect.forced_calls(limited_tools(request), request.tool_choice,
                                          request.parallel_tool_calls, self.lark_text)
        prefix = self._reasoning(opens_reasoning, request.params.reasoning_budget)
        return forced_grammar(calls + prefix.rules, prefix.start)

    def _tools_or_answer(self, request: ChatRequest, opens_reasoning: bool) -> Constraint | None:
        """Tools offered ("auto") beside a JSON constraint: a call to any tool, in this
        model's syntax, or the answer the constraint describes (one grammar, either reply).
        Unless the request says ``repeat_answered_calls``, a call that repeats one the
        history answered is refused (``answered_calls``), and a tool called
        ``tool_call_limit`` times is no longer offered; with no call left, the answer."""
        params = request.params
        answer = cast(JsonSchema | JsonObject | None, params.constraint)
        answered = answered_arguments(request.messages)
        tools = within_limit(request.tools, answered, params.tool_call_limit)
        if not params.repeat_answered_calls:
            tools = unanswered_tools(tools, answered, self.dialect.json_arguments)
        if not tools:
            return self._answer_alone(answer, opens_reasoning, params.reasoning_budget)
        calls = self.dialect.forced_calls(tools, "required", request.parallel_tool_calls,
                                          self.lark_text)
        prefix = self._reasoning(opens_reasoning, params.reasoning_budget)
        return tools_or_answer_grammar(calls + prefix.rules, answer, prefix.start,
                                       self._answer_head())

    def _answer_alone(self, answer: Constraint | None, opens_reasoning: bool,
                      budget: int | None) -> Constraint | None:
        """The answer with no call beside it, in the family's answer frame: after the
        close of a block the prompt opened (at once, or within a budget), or after an
        optional bounded block the model may open. Free text gets a grammar only from a
        budget; a constraint nothing precedes is taken as it is."""
        if answer is None and (budget is None or not self._has_reasoning(opens_reasoning)):
            return None  # free text, no budget: nothing to constrain
        prefix = self._reasoning(opens_reasoning, budget)
        head = self._answer_head()
        if answer is not None and not head and not prefix.start:
            return answer
        return budgeted_answer(answer, prefix, head)

    def _has_reasoning(self, opens_reasoning: bool) -> bool:
        """Whether the family has a reasoning block a budget can shape here: one the prompt
        opened, or one the model may open itself (without markers a budget does nothing)."""
        if opens_reasoning:
            return self.dialect.reasoning_close is not None
        return self.dialect.model_reasoning is not None

    def _reasoning(self, opens_reasoning: bool, budget: int | None) -> ReasoningPrefix:
        """Lark for the reasoning before the answer or call. A block the prompt opened is
        closed at once, or after at most ``budget`` tokens; one the model may open is
        optional and holds at most ``budget`` tokens (none without a budget, or at 0)."""
        literal = self.lark_text
        close = self.dialect.reasoning_close
        if opens_reasoning:
            if close is None:
                return ReasoningPrefix()
            return reasoning_prefix(literal(close), literal(self.dialect.after_reasoning),
                                    budget)
        marks = self.dialect.model_reasoning
        if marks is None:
            return ReasoningPrefix()
        return optional_reasoning(literal(marks.open), literal(marks.close),
                                  literal(marks.after), budget)

    def _answer_head(self) -> str:
        """Lark for what the family writes before an answer (gpt-oss's final channel)."""
        head = self.dialect.answer_head
        return self.lark_text(head) if head else ""


def limited_tools(request: ChatRequest) -> tuple[ToolSpec, ...]:
    """The tools a forced call may go to: with ``tool_call_limit``, a required call is
    never to a tool the history already called and answered that many times (a tool the
    choice names is the caller's explicit wish and stays)."""
    if request.tool_choice != "required" or request.params.tool_call_limit is None:
        return request.tools  # no history to read
    return within_limit(request.tools, answered_arguments(request.messages),
                        request.params.tool_call_limit)
