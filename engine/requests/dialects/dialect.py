"""A model family's dialect: how its output carries reasoning and tool calls, and how a
forced call is written in that same syntax.

A tokenizer (its chat template, its vocabulary, what mlx-lm inferred) picks one dialect
(``engine.requests.dialects.registry``). The dialect gives the row its ``Splitter``, the
output side: text in, ``(channel, text)`` pieces out, with reasoning in the reasoning
channel and each tool call in the tool channel. Calls the splitter hands over as JSON call
objects (``{"name": ..., "arguments": {...}}``, alone or as a list) stream as argument
fragments as they are written (``RowChannels`` reads them); a dialect with a ``parser``
has its blocks parsed whole when they close instead. ``forced_calls`` is the constraint
side: the Lark rule ``calls`` that admits only well-formed calls to the chosen tools,
written as this family writes them, so a forced call is text the model was trained to
write and its own parser reads back. ``new_call_id`` is what the family's chat template
accepts as a call id, and ``history`` adapts a past conversation to what that template
renders.

A family declares, as class attributes, what the rest of the engine reads without an
instance: its detection ``priority`` (the registry checks families highest first), the
``reasoning_tokens`` whose presence in a vocabulary says the model reasons
(``engine.declared``), and the ``tool_formats`` its models were trained on where the chat
template renders no tools (``PromptRenderer``). No mlx here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.requests.constraints.forced_calls import tagged_json_calls
from engine.requests.inbound.tool_prompts import (
    SMOLLM2,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolFormat,
)
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL, ChannelSplitter, Splitter
from engine.requests.outbound.tool_calls import ToolParser, new_call_id


@dataclass(frozen=True)
class ReasoningMarks:
    """A reasoning block as the model writes it: the text that opens it, the text that
    closes it, and what the family writes between the close and the answer."""

    open: str
    close: str
    after: str


# Lark for a text: its special tokens as tokens, the rest as quoted strings (the
# tokenizer's; ``GrammarCompiler.lark_text``).
Literal = Callable[[str], str]


@dataclass(frozen=True)
class TokenizerFacts:
    """What a dialect is recognised by, read once from mlx-lm's ``TokenizerWrapper``."""

    chat_template: str = ""
    vocab: Mapping[str, int] = field(default_factory=dict)
    markers: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # mlx-lm's
    tool_parser: ToolParser | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerFacts:
        template = getattr(tokenizer, "chat_template", None)
        markers: dict[str, tuple[str, str]] = {}
        if getattr(tokenizer, "has_tool_calling", False):
            markers[TOOL] = (tokenizer.tool_call_start, tokenizer.tool_call_end)
        if getattr(tokenizer, "has_thinking", False):
            markers[REASONING] = (tokenizer.think_start, tokenizer.think_end)
        parser = tokenizer.tool_parser if getattr(tokenizer, "has_tool_calling", False) else None
        return cls(template if isinstance(template, str) else "", tokenizer.get_vocab(),
                   markers, parser)

    @property
    def parser_name(self) -> str:
        """The mlx-lm tool parser's module name (``json_tools``, ``mistral``...), or ""."""
        module = getattr(self.tool_parser, "__module__", "") or ""
        return module.rpartition(".")[2] if "tool_parsers" in module else ""


class Dialect:
    """The default: calls in the tool markers mlx-lm inferred (``<tool_call>`` JSON when it
    inferred none, the format the fallback tool prompt asks for), reasoning in its thinking
    markers. A family overrides what it writes differently."""

    name = "tagged-json"

    # ----- declarations (read from the class, before any tokenizer) ------------------------

    # Detection order: the registry checks families highest first, so a family whose marks
    # another's include goes above it. 0 is the default's: never checked, picked last.
    priority: ClassVar[int] = 0

    # Token pairs that open and close reasoning: a vocabulary holding both of a pair is a
    # thinking model's (``engine.declared``). The default's are mlx-lm's thinking tokens.
    reasoning_tokens: ClassVar[tuple[tuple[str, str], ...]] = (
        ("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
        ("<|think:start|>", "<|think:end|>"))

    # The tool prompts this dialect's models were trained on, each recognised by a marker in
    # the chat template, for templates that render no tools (SmolLM2's, in tagged JSON).
    tool_formats: ClassVar[tuple[ToolFormat, ...]] = (SMOLLM2,)

    # Whether the family's splitter hands its calls over as JSON call objects itself, so
    # the tool parser mlx-lm inferred (if any) is not used.
    writes_json_calls: ClassVar[bool] = False

    def __init__(self, facts: TokenizerFacts) -> None:
        self.facts = facts

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        """Whether a tokenizer speaks this dialect (the default speaks for any)."""
        return True

    # ----- output --------------------------------------------------------------------

    @property
    def markers(self) -> dict[str, tuple[str, str]]:
        """Channel -> (open, close) text markers of reasoning and tool calls."""
        markers = dict(self.facts.markers)
        markers.setdefault(TOOL, (TOOL_CALL_START, TOOL_CALL_END))
        return markers

    @property
    def parser(self) -> ToolParser | None:
        """The parser of a closed tool block; None when blocks are JSON call objects (the
        tagged-JSON fallback, SmolLM2's list, mlx-lm's ``json_tools``, a family's splitter
        that writes them), read as they stream."""
        if self.writes_json_calls or self.facts.parser_name == "json_tools":
            return None
        return self.facts.tool_parser

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        """A new row's splitter; ``start`` is the channel its output begins in, ``tools``
        the request's (a family whose calls are not JSON reads values by their schema)."""
        # Blocks of JSON calls end at a close marker outside the JSON's strings.
        json_blocks = frozenset({TOOL}) if self.parser is None else frozenset()
        return ChannelSplitter(self.markers, start, json_blocks)

    def new_call_id(self) -> str:
        return new_call_id()

    # ----- input ---------------------------------------------------------------------

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Template-ready messages as this family's chat template accepts them (call ids in
        its form, calls split as it renders them); the default leaves them as they are."""
        return messages

    # ----- constraints ---------------------------------------------------------------

    # Whether a call's arguments are one JSON object the grammar reads with the tool's
    # argument schema as a whole (so a rewritten schema, e.g. one that refuses answered
    # calls, applies as written); families that write values in their own syntax from the
    # schema's properties say False.
    json_arguments = True

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """Lark defining ``calls``: one call (several when ``parallel``) to the chosen tools,
        each ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in this
        tokenizer's markers."""
        start, end = self.markers[TOOL]
        return tagged_json_calls(tools, choice, parallel, literal(start), literal(end))

    @property
    def call_opener(self) -> str:
        """The text before each call's JSON (empty where a call is bare JSON)."""
        return self.markers.get(TOOL, ("", ""))[0]

    @property
    def structural_markers(self) -> tuple[str, ...]:
        """Text that must never be written inside a call's argument strings: what opens
        and closes a call (``string_markers`` refuses it there, so a model that starts one
        is steered to close the string instead)."""
        return tuple(marker for marker in self.markers.get(TOOL, ()) if marker)

    @property
    def reasoning_close(self) -> str | None:
        """Text that ends the reasoning block, when the family has one."""
        pair = self.markers.get(REASONING)
        return pair[1] if pair else None

    # What the chat template writes between the end of the reasoning and the answer.
    after_reasoning = "\n\n"

    @property
    def model_reasoning(self) -> ReasoningMarks | None:
        """The reasoning block as the model opens it itself, where the prompt left it
        closed (a reasoning budget then makes it optional and bounded); None when the
        family has no reasoning markers."""
        pair = self.markers.get(REASONING)
        close = self.reasoning_close
        if pair is None or close is None:
            return None
        return ReasoningMarks(pair[0], close, self.after_reasoning)

    # What the family writes before an answer (a header the model writes itself); a
    # constrained answer's grammar starts with it. Empty: the answer is the text itself.
    answer_head = ""

