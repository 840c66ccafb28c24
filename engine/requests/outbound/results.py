"""What a caller gets back: events as a request streams, the whole completion, usage.

Pure data: no mlx import, so the scheduler and streams can be tested without a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.errors import OutputTruncatedError
from engine.requests.inbound.output_constraint import Constraint, JsonObject, JsonSchema
from engine.requests.outbound.tool_calls import InvalidToolCall, ToolCall, ToolCallDelta


class FinishReason(str, Enum):
    """Why a request's stream ended.

    ``TOOL_CALLS`` is a ``STOP`` whose answer holds tool calls (as OpenAI reports it); both
    are normal completions. ``LENGTH`` stays ``LENGTH`` even with calls: the cut is the news.
    """

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and, if asked, the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token counts and timings of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token: float | None = None
    decode_tokens_per_second: float | None = None
    # Of ``completion_tokens``, those generated inside the reasoning block (its markers
    # aside): tokens whose text the row's channels sorted into reasoning.
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        """The one shape of usage: every face renames these keys, none computes its own."""
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "cached_tokens": self.cached_tokens,
                "time_to_first_token": self.time_to_first_token,
                "decode_tokens_per_second": self.decode_tokens_per_second,
                "reasoning_tokens": self.reasoning_tokens}


@dataclass(frozen=True)
class StreamEvent:
    """One step of a request; the last one has ``finish_reason``, ``usage``, ``completion``.

    ``text`` is the raw new text; ``content`` and ``reasoning`` split it into the answer
    and the model's thinking, with tool-call markup left out. ``tool_call_deltas`` are the
    pieces of tool calls written at this step (``engine.ToolCallDelta``: a call's name
    first, then its arguments in fragments); a call the engine may still drop is held back,
    so over a stream they add up to exactly ``completion.tool_calls``, plus any call that
    was cut (or malformed) after it went out, listed in ``completion.invalid_tool_calls``.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: BaseException | None = None
    content: str = ""
    reasoning: str = ""
    completion: Completion | None = None
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole request's output: raw ``text``, and ``content`` / ``reasoning`` / tool calls."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    # What max_tokens cut before it was complete, where a cut breaks the answer: "the
    # forced tool call" or "the structured output (JSON)"; None when nothing that had to
    # be whole was cut. The faces raise OutputTruncatedError from this, not from a guess.
    truncated: str | None = None

    def truncation_error(self, what: str | None = None) -> OutputTruncatedError | None:
        """The ``OutputTruncatedError`` for a cut output (``what`` renames the output)."""
        if self.truncated is None:
            return None
        tokens = self.usage.completion_tokens
        return OutputTruncatedError(tokens, tokens, what or self.truncated)


FORCED_CALL = "the forced tool call"
STRUCTURED_JSON = "the structured output (JSON)"
TOOL_CALL = "a tool call"


def truncation(finish_reason: FinishReason, forces_call: bool, constraint: Constraint | None,
               content: str, calls: int, invalid_calls: int) -> str | None:
    """What a row's ending cut, if it matters (see ``Completion.truncated``).

    A forced call's grammar makes every closed call valid, so an invalid call of a forced
    answer is one that was cut; a reply of tools beside a JSON answer that took the call
    branch is cut when a call was left open; strict JSON is cut when the text is not one
    whole value.
    """
    if finish_reason != FinishReason.LENGTH:
        return None
    if forces_call:
        return FORCED_CALL if invalid_calls or not calls else None
    json_answer = isinstance(constraint, JsonSchema | JsonObject)
    if json_answer and (calls or invalid_calls):
        return TOOL_CALL if invalid_calls else None
    if json_answer and not _whole_json(content):
        return STRUCTURED_JSON
    return None


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
