# ruff: noqa: RUF002  (DeepSeek's tokens are spelled with fullwidth bars, as quoted here)
"""DeepSeek-R1's calls (its distills onto Qwen and Llama included).

The chat template writes a call turn as (one line, broken here)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n
    {"city": "Paris"}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with ``\\n`` before each further ``<｜tool▁call▁begin｜>``. Reasoning is ``<think>...</think>``,
opened by the prompt when thinking is on: a forced call closes it first (``Preparer``).
DeepSeek-R1 has the markers as tokens; its distills onto Qwen and Llama keep their base's
vocabulary, where the template writes them as text that splits into ordinary tokens. Both
are read and forced as text (the splitter reads text; ``literal`` spells a marker that is
no token as a quoted string). No mlx here.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.requests.dialects.call_rules import calls_lark, json_arguments
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.marked_calls import CallSyntax, MarkedCallSplitter
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL, Splitter


def _token(words: str) -> str:
    """A DeepSeek token: fullwidth bars around words joined by U+2581 ("▁")."""
    return "<\uff5c" + "\u2581".join(words.split()) + "\uff5c>"


CALLS_BEGIN, CALLS_END = _token("tool calls begin"), _token("tool calls end")
CALL_BEGIN, CALL_END = _token("tool call begin"), _token("tool call end")
SEP = _token("tool sep")
_FENCE = "```json"


def _name_of(header: str) -> str | None:
    """``function<｜tool▁sep｜>NAME\\n`` -> NAME."""
    kind, sep, name = header.partition(SEP)
    name = name.strip()
    return name if sep and name and kind.strip() == "function" else None


SYNTAX = CallSyntax(open=CALL_BEGIN, args=_FENCE, name_of=_name_of, close=CALL_END,
                    dropped=(CALLS_BEGIN, CALLS_END))


class DeepSeekR1(Dialect):
    """DeepSeek-R1 and its distills (their tool-call markers, tokens or text)."""

    name = "deepseek-r1"
    priority = 50  # above the Qwen and Llama families its distills are built on
    writes_json_calls = True

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        """DeepSeek's call markers as tokens, or (a distill's) as text of its template."""
        marks = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END)
        return (all(mark in facts.vocab for mark in marks)
                or all(mark in facts.chat_template for mark in marks))

    @property
    def markers(self) -> dict[str, tuple[str, str]]:
        return {**self.facts.markers, TOOL: (CALLS_BEGIN, CALLS_END)}

    @property
    def call_opener(self) -> str:
        return CALL_BEGIN  # each call of a block opens with it

    @property
    def structural_markers(self) -> tuple[str, ...]:
        return (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        return MarkedCallSplitter(SYNTAX, self.markers.get(REASONING), start)

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """The calls block as the template writes it; parallel calls one a line."""
        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            head = literal(f"function{SEP}{tool.name}\n{_FENCE}\n")
            return (f"{literal(CALL_BEGIN)} {head} {json_arguments(i, tool, rules)} "
                    f"{literal(chr(10) + '```')} {literal(CALL_END)}")
        return calls_lark(tools, choice, parallel, body, between='"\\n"',
                          around=(literal(CALLS_BEGIN), literal(CALLS_END)))
