"""Mistral's calls (Tekken tokenizers: Mistral Small 3.x, Ministral 3, Magistral).

Each call is ``[TOOL_CALLS]NAME[ARGS]{json}`` (Ministral 3) or, where the chat template
renders call ids, ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}`` (Mistral Small 3.2); several
calls follow one another, each with its own ``[TOOL_CALLS]``; ``</s>`` ends the turn.
Reasoning models write ``[THINK]...[/THINK]`` before the answer. The templates refuse any
call id that is not 9 alphanumerics, so the engine makes such ids, and a history with other
ids (from another provider) has them mapped, the same id to the same 9 characters, before
the template sees it. No mlx here.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from engine.requests.dialects.call_rules import calls_lark, json_arguments
from engine.requests.dialects.dialect import Dialect, Literal, TokenizerFacts
from engine.requests.dialects.marked_calls import CallSyntax, MarkedCallSplitter
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL, Splitter

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK, END_THINK = "[THINK]", "[/THINK]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME = re.compile(r"[\w.\-]+")


def _name_of(header: str) -> str | None:
    """``NAME`` or ``NAME[CALL_ID]ID`` -> NAME (the model's own id is not kept: the engine
    gives every call an id of its own, in the form the template accepts)."""
    name = header.split(CALL_ID, 1)[0].strip()
    return name if _NAME.fullmatch(name) else None


# The older ``[TOOL_CALLS][{"name": ..., "arguments": ...}]`` form is read too.
SYNTAX = CallSyntax(open=TOOL_CALLS, args=ARGS, name_of=_name_of, json_list=True)


class Mistral(Dialect):
    """Mistral Small 3.x and Ministral 3 (their ``[TOOL_CALLS]`` and ``[ARGS]`` tokens)."""

    name = "mistral"
    priority = 60
    # Every Tekken vocabulary has [THINK]: only the chat template says whether the model
    # reasons (``reasons``), so the vocabulary alone declares nothing.
    reasoning_tokens = ()
    writes_json_calls = True  # mlx-lm 0.32.2's parser misreads ids

    @classmethod
    def matches(cls, facts: TokenizerFacts) -> bool:
        return TOOL_CALLS in facts.vocab and ARGS in facts.vocab

    @property
    def structural_markers(self) -> tuple[str, ...]:
        return (TOOL_CALLS, ARGS, CALL_ID)

    @property
    def markers(self) -> dict[str, tuple[str, str]]:
        markers = {TOOL: (TOOL_CALLS, "")}
        if self.reasons:
            markers[REASONING] = (THINK, END_THINK)
        return markers

    @property
    def reasons(self) -> bool:
        """Whether the model writes ``[THINK]`` blocks (its template renders them)."""
        return THINK in self.facts.vocab and THINK in self.facts.chat_template

    @property
    def writes_call_ids(self) -> bool:
        """Whether the template renders ``[CALL_ID]`` (Mistral Small 3.2; not Ministral 3)."""
        return CALL_ID in self.facts.chat_template

    def splitter(self, start: str = CONTENT, tools: Sequence[ToolSpec] = ()) -> Splitter:
        return MarkedCallSplitter(SYNTAX, self.markers.get(REASONING), start)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Call ids the template refuses (another provider's ``call_...``) mapped to 9
        alphanumerics: a call and its result keep matching, and the same history maps the
        same way every turn, so its prompt prefix stays cached."""
        return [_with_ids(message) for message in messages]

    def forced_calls(self, tools: Sequence[ToolSpec], choice: str, parallel: bool,
                     literal: Literal) -> str:
        """``[TOOL_CALLS]NAME[ARGS]{json}``, with ``[CALL_ID]`` and 9 alphanumerics where
        the template renders ids; parallel calls follow one another."""
        call_id = f' {literal(CALL_ID)} /[A-Za-z0-9]{{9}}/' if self.writes_call_ids else ""

        def body(i: int, tool: ToolSpec, rules: list[str]) -> str:
            return (f"{literal(TOOL_CALLS)} {literal(tool.name)}{call_id} {literal(ARGS)} "
                    f"{json_arguments(i, tool, rules)}")
        return calls_lark(tools, choice, parallel, body)


def template_call_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates accept it: itself when it is 9 alphanumerics,
    else 9 alphanumerics derived from it (stable, so a call and its result still match)."""
    if _ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        out.append(_ALPHANUMERIC[digit])
    return "".join(out)


def _with_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = template_call_id(out["tool_call_id"])
    if out.get("tool_calls"):
        out["tool_calls"] = [{**call, "id": template_call_id(str(call.get("id") or ""))}
                             for call in out["tool_calls"]]
    return out
