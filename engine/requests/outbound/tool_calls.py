"""Tool calls as the engine reports them, and reading one call's text into one.

``ToolCall`` (kept), ``InvalidToolCall`` (call-like output that did not parse, reported,
never raised) and ``ToolCallDelta`` (a piece of a call as it streams). ``parse_call``
prefers the model's mlx-lm tool parser and falls back to tagged JSON. No mlx.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.requests.inbound.tool_specs import ToolSpec

ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: a unique id, the tool's name and its arguments.

    ``text`` is the model's own text of the arguments object when the call streamed it
    (``engine.requests.outbound.row_channels``); it parses to ``arguments``.
    """

    id: str
    name: str
    arguments: dict[str, Any]
    text: str | None = None

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text: what every face sends, streamed or whole (one spelling,
        so a client's concatenated argument deltas equal the call it would get whole). The
        model's own text when the call streamed as it was generated, else ``arguments``
        serialised."""
        if self.text is not None:
            return self.text
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call as it streams (``StreamEvent.tool_call_deltas``).

    ``index`` is the call's place among the calls the stream sent: its place in
    ``Completion.tool_calls``, unless a call sent before it ended invalid (cut by the end
    of the row, or malformed at its close), which keeps its index and is listed in
    ``Completion.invalid_tool_calls`` with it. The first piece of a call carries its ``id``
    and ``name`` (``arguments`` ""); the ``arguments`` pieces that follow are the model's
    text as it is generated, and for a kept call they concatenate to its ``arguments_text``.
    A call that may still be dropped (a repeat, an extra call with parallel calls off) is
    held back until it cannot be, so a call the engine drops never appears here.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def call_deltas(index: int, call: ToolCall) -> tuple[ToolCallDelta, ...]:
    """The deltas of a call released whole: its id, name and arguments in one piece."""
    return (ToolCallDelta(index, call.id, call.name, call.arguments_text),)


@dataclass(frozen=True)
class InvalidToolCall:
    """Call-like output that did not parse; reported, never raised."""

    id: str
    name: str | None
    raw: str
    error: str
    index: int | None = None  # the index its pieces streamed under; None: never streamed


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(raw: str, parser: ToolParser | None, tools: Sequence[ToolSpec],
               new_id: Callable[[], str] = new_call_id) -> ToolCall | InvalidToolCall:
    """Parse one call's markup body with the model's parser, else as tagged JSON."""
    text = raw.strip()
    call_id = new_id()
    try:
        parsed = parser(text, [t.as_openai() for t in tools]) if parser else json.loads(text)
        if isinstance(parsed, list) and len(parsed) == 1:
            parsed = parsed[0]
        if not isinstance(parsed, Mapping):
            raise ValueError("a tool call must be a JSON object")
        name = parsed.get("name")
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(name, str) or not name:
            raise ValueError("the call has no tool name")
        if not isinstance(arguments, Mapping):
            raise ValueError("the call's arguments are not a JSON object")
    except Exception as exc:  # any parser failure is reported, not raised
        guess = _guess_name(text)
        return InvalidToolCall(call_id, guess, raw, f"{type(exc).__name__}: {exc}")
    return ToolCall(call_id, name, dict(arguments))


def _guess_name(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value.get("name") if isinstance(value, dict) else None


def call_key(call: ToolCall) -> str:
    """Identity of a call for spotting repeats: its name and its arguments as parsed JSON."""
    return json.dumps([call.name, call.arguments], sort_keys=True, ensure_ascii=False,
                      default=repr)


def split_call_list(raw: str) -> list[str] | None:
    """A call body holding a JSON list of several calls -> one JSON text per call.

    None when the body is not such a list (one call, or not JSON): it is parsed as is.
    """
    try:
        value = json.loads(raw.strip())
    except ValueError:
        return None
    if isinstance(value, list) and len(value) != 1:
        return [json.dumps(item) for item in value]
    return None
