"""A request prepared once, outside the step loop: prompt ids, tools, constraint, stops.

Every door hands ``Engine.submit`` one request value (``ChatRequest`` or ``TextRequest``,
checked when it was built); ``checked_request`` adds, on the caller's thread, what needs
no tokenizer. ``Preparer`` turns it into a ``PreparedRequest`` for this model's
tokenizer: the prompt rendered and encoded, the forced-call grammar (or the union of calls
and a JSON answer, for tools beside a schema) built and compiled, the stop ids resolved.
The loop only ever sees prepared requests. No mlx here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from engine.errors import InvalidRequestError
from engine.requests.constraints.answered_calls import (
    answered_arguments,
    unanswered_tools,
    within_limit,
)
from engine.requests.constraints.forced_calls import forced_call_schema, forced_grammar
from engine.requests.constraints.grammar import GrammarCompiler, validate_constraint
from engine.requests.constraints.reasoning_budget import (
    ReasoningPrefix,
    budgeted_answer,
    optional_reasoning,
    reasoning_prefix,
)
from engine.requests.constraints.string_repeats import DEFAULT_NGRAM
from engine.requests.constraints.tools_or_answer import joins_tools, tools_or_answer_grammar
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.output_constraint import Constraint, JsonObject, JsonSchema
from engine.requests.inbound.prompts import EncodedPrompt, PromptRenderer
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.inbound.text_request import Request, TextRequest
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText


@dataclass(frozen=True)
class PreparedRequest:
    """What the loop and the lanes need: ids, final sampling settings, stops, channels."""

    prompt_ids: list[int]
    params: SamplingParams  # with the forced-call grammar as its constraint, if any
    stop_ids: frozenset[int]
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none
    start_channel: str = CONTENT
    forces_call: bool = False  # the tool choice forces a call (a cut one is truncation)


class Preparer:
    """Prepares requests for one tokenizer; lives on the engine thread."""

    def __init__(self, tokenizer: Any, model_path: Path, vocab_size: int,
                 json_string_ngram: int = DEFAULT_NGRAM) -> None:
        self.tokenizer = tokenizer
        self.dialect = dialect_for(TokenizerFacts.of(tokenizer))
        self.prompts = PromptRenderer(tokenizer, model_path, vocab_size,
                                      self.dialect.tool_formats)
        self.compiler = GrammarCompiler(tokenizer._tokenizer, vocab_size,
                                        string_ngram=json_string_ngram)

    def prepare(self, request: Request) -> PreparedRequest:
        """Render, encode and compile; raises the request's own error if it cannot run."""
        request.params.check_vocabulary(self.prompts.vocab_size)
        params = request.params
        if isinstance(request, TextRequest):
            encoded = EncodedPrompt(self.prompts.encode(request.prompt))
            forces_call = False
        else:
            encoded = self._encoded_chat(request)
            forces_call = request.forces_call
            params = replace(params, constraint=self._chat_constraint(
                request, encoded.opens_reasoning))
        if params.constraint is not None:
            self.compiler.compile(params.constraint)  # cached: the lane's matcher reuses it
        return PreparedRequest(encoded.ids, params, self.stop_ids(params), encoded.head_len,
                               REASONING if encoded.opens_reasoning else CONTENT, forces_call)

    def count_tokens(self, request: Request) -> int:
        """Prompt tokens the request would use (rendered and encoded as ``prepare`` does)."""
        if isinstance(request, TextRequest):
            return len(self.prompts.encode(request.prompt))
        return len(self._encoded_chat(request).ids)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        return eos | frozenset(params.stop_token_ids)

    def row_text(self, params: SamplingParams) -> RowText:
        return RowText(self.tokenizer.detokenizer, params.stop)

    def row_channels(self, request: Request, prepared: PreparedRequest) -> RowChannels:
        dialect = self.dialect
        if isinstance(request, TextRequest):
            splitter = dialect.splitter(prepared.start_channel)
            return RowChannels(splitter, dialect.parser, (), new_id=dialect.new_call_id)
        splitter = dialect.splitter(prepared.start_channel, request.tools)
        return RowChannels(splitter, dialect.parser, request.tools,
                           request.parallel_tool_calls, new_id=dialect.new_call_id)

    def _encoded_chat(self, request: ChatRequest) -> EncodedPrompt:
        return self.prompts.encode_request(request.messages, request.rendered_tools,
                                           dict(request.template_kwargs),
                                           history=self.dialect.history)

    def _chat_constraint(self, request: ChatRequest,
                         opens_reasoning: bool) -> Constraint | None:
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
                                          request.parallel_tool_calls, self.compiler.lark_text)
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
                                          self.compiler.lark_text)
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
        literal = self.compiler.lark_text
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
        head = self.dialect.answer_head
        return self.compiler.lark_text(head) if head else ""


def checked_request(request: Any) -> Request:
    """Everything ``submit`` can check without a tokenizer that building the request did
    not: its type, and that its output constraint or forced call compiles (once per
    distinct schema). Returns the request as it is: nothing is converted again."""
    if not isinstance(request, ChatRequest | TextRequest):
        hint = (" (chat messages: ChatRequest.from_openai(messages, params, tools=...); text "
                "or token ids: TextRequest(prompt, params))")
        raise TypeError(f"submit takes a ChatRequest or a TextRequest, got "
                        f"{type(request).__name__}{hint}")
    if isinstance(request, ChatRequest) and request.forces_call:
        if not limited_tools(request):
            raise InvalidRequestError(
                f"tool_call_limit={request.params.tool_call_limit}: every tool was already "
                "called that many times and tool_choice requires a call; raise the limit, "
                "name a tool, or let the model answer (tool_choice 'auto')", "tool_call_limit")
        # The call's schema now; its grammar is built when the request is prepared.
        _validated(JsonSchema(forced_call_schema(request.tools, request.tool_choice)))
        return cast(Request, request)
    if request.params.constraint is not None:
        _validated(request.params.constraint)
        if isinstance(request, ChatRequest) and request.rendered_tools and joins_tools(
                request.params.constraint):  # the union's call branch: any tool
            _validated(JsonSchema(forced_call_schema(request.tools, "required")))
    return cast(Request, request)


def limited_tools(request: ChatRequest) -> tuple[ToolSpec, ...]:
    """The tools a forced call may go to: with ``tool_call_limit``, a required call is
    never to a tool the history already called and answered that many times (a tool the
    choice names is the caller's explicit wish and stays)."""
    if request.tool_choice != "required" or request.params.tool_call_limit is None:
        return request.tools  # no history to read
    return within_limit(request.tools, answered_arguments(request.messages),
                        request.params.tool_call_limit)


@lru_cache(maxsize=256)
def _validated(constraint: Constraint) -> None:
    """``validate_constraint``, once per distinct schema or grammar (a refusal is not cached:
    it raises again, cheaply, for the next request that sends it)."""
    validate_constraint(constraint)
