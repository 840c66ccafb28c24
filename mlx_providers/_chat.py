"""Pure chat plumbing shared by both adapters (no LangChain, no LlamaIndex, no mlx).

Adapters turn their framework's messages into plain dicts; ``normalize_messages`` then
makes any history an agent can produce safe for chat templates: text-only content,
canonical roles, tool calls with dict arguments, tool results as strings, one leading
system message, and no two plain messages of the same role in a row.

It also says, once for both adapters, when ``max_tokens`` cut an output that had to be
complete (``OutputTruncatedError``): structured JSON, or a call the caller forced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine import Completion, FinishReason, OutputTruncatedError

_ROLES = {"human": "user", "user": "user", "ai": "assistant", "assistant": "assistant",
          "system": "system", "developer": "system", "tool": "tool", "function": "tool",
          "chatbot": "assistant", "model": "assistant"}


# Content parts whose text is the prompt's.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def content_text(content: Any, at: str = "content") -> str:
    """Text of a message's content: a string, or a list of parts (str or typed dicts).

    Text parts are joined; other typed parts are dropped: reasoning and tool-call blocks
    carry no prompt text (calls are rendered from ``tool_calls``), and a text-only model
    cannot see media (LangChain's documented behaviour, tested). Anything that is not text
    or a typed part raises ``TypeError`` naming ``at``, never ``str()`` of it.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        return _part_text(content, at)
    if isinstance(content, (bytes, bytearray)) or not isinstance(content, Iterable):
        raise TypeError(f"{at} must be text (a str or a list of content parts), got "
                        f"{type(content).__name__} {content!r:.40}")
    return "".join(part if isinstance(part, str) else _part_text(part, f"{at}[{i}]")
                   for i, part in enumerate(content))


def _part_text(part: Any, at: str) -> str:
    if not isinstance(part, Mapping):
        raise TypeError(f"{at} must be a str or a content-part dict, got "
                        f"{type(part).__name__} {part!r:.40}")
    kind = part.get("type", "text")
    if kind in _TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"{at}: a {kind!r} part needs 'text' as a str, got "
                            f"{type(text).__name__}")
        return text
    if not isinstance(kind, str):
        raise TypeError(f"{at}.type must be a str, got {type(kind).__name__}")
    return ""  # reasoning, tool calls, media: no prompt text for a text-only model


def arguments_dict(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as a dict, whether given as a dict or as JSON text."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str) and arguments.strip():
        try:
            value = json.loads(arguments)
        except ValueError:
            return {"input": arguments}
        return value if isinstance(value, dict) else {"input": value}
    return {}


def tool_call_dict(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """One assistant tool call in the OpenAI shape chat templates expect."""
    return {"id": call_id or "", "type": "function",
            "function": {"name": name, "arguments": arguments_dict(arguments)}}


def _role(message: Mapping[str, Any], at: str) -> str:
    role = message.get("role")
    key = role.lower() if isinstance(role, str) else None
    if key not in _ROLES:
        raise ValueError(f"{at}.role must be one of {sorted(_ROLES)}, got {role!r:.40}")
    return _ROLES[key]


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history any template accepts; never raises for shapes agents produce.

    What no agent produces raises TypeError/ValueError naming ``messages[i]`` and the
    field: an unknown role, content that is not text, malformed tool calls.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise TypeError(f"messages must be a list of chat messages, got "
                        f"{type(messages).__name__} {messages!r:.40}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{at} must be a chat message, got {type(message).__name__}")
        role = _role(message, at)
        item: dict[str, Any] = {"role": role,
                                "content": content_text(message.get("content"), f"{at}.content")}
        if role == "tool":
            if message.get("status") == "error" and not item["content"].startswith("Error"):
                item["content"] = f"Error: {item['content']}"
            for key in ("tool_call_id", "name"):
                if message.get(key):
                    item[key] = _text_field(message[key], f"{at}.{key}")
        elif message.get("name"):
            item["name"] = _text_field(message["name"], f"{at}.name")
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Iterable):
                raise TypeError(f"{at}.tool_calls must be a list of calls, got "
                                f"{type(calls).__name__}")
            item["tool_calls"] = [_canonical_call(c, f"{at}.tool_calls[{j}]")
                                  for j, c in enumerate(calls)]
        if role == "system" and out:
            # Templates reject a system message after the first turn; keep its text.
            role, item["role"] = "user", "user"
            item["content"] = f"[system] {item['content']}"
        previous = out[-1] if out else None
        if previous is not None and _mergeable(previous, item):
            previous["content"] = f"{previous['content']}\n\n{item['content']}".strip()
            continue
        out.append(item)
    return out


def _text_field(value: Any, at: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{at} must be a str, got {type(value).__name__} {value!r:.40}")
    return value


def _canonical_call(call: Any, at: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise TypeError(f"{at} must be a tool call dict, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise TypeError(f"{at}.function must be a dict with name and arguments, got "
                        f"{type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{at}: a tool call needs its tool's name as a str, got {name!r:.40}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise TypeError(f"{at}.id must be a str, got {type(call_id).__name__}")
    arguments = fn.get("arguments", fn.get("args"))
    if arguments is not None and not isinstance(arguments, str | Mapping):
        raise TypeError(f"{at}: arguments must be a dict or JSON text, got "
                        f"{type(arguments).__name__}")
    return tool_call_dict(call_id, name, arguments)


def _mergeable(previous: Mapping[str, Any], item: Mapping[str, Any]) -> bool:
    plain = ("tool_calls", "tool_call_id", "name")
    return (previous["role"] == item["role"] and item["role"] in ("user", "system")
            and not any(k in previous or k in item for k in plain))


# ----- outputs cut at max_tokens ------------------------------------------------------


def forces_call(tools: Any, tool_choice: Any) -> bool:
    """Whether a request forces a tool call: tools, and a choice other than auto/none."""
    if not tools or tool_choice is None or tool_choice is False:
        return False
    return not (isinstance(tool_choice, str) and tool_choice in ("auto", "none"))


def _is_length(finish_reason: Any) -> bool:
    """A finish reason (the enum or its value, as adapters' metadata hold it) is "length"."""
    return bool(getattr(finish_reason, "value", finish_reason) == FinishReason.LENGTH.value)


def json_complete(text: str) -> bool:
    """Whether ``text`` is one whole JSON value (a cut one never is)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def cut_json(finish_reason: Any, text: str, completion_tokens: int,
             what: str = "the structured output (JSON)") -> OutputTruncatedError | None:
    """The error for JSON that ``max_tokens`` cut before it was whole, else None."""
    if not _is_length(finish_reason) or json_complete(text):
        return None
    return OutputTruncatedError(completion_tokens, completion_tokens, what)


def cut_call(finish_reason: Any, complete_calls: int, open_calls: int,
             completion_tokens: int) -> OutputTruncatedError | None:
    """The error for a forced call that ``max_tokens`` cut: a call was left open, or none
    was made. A forced call's grammar makes every closed call valid, so any invalid call
    of a forced answer is one that was cut."""
    if not _is_length(finish_reason) or (complete_calls and not open_calls):
        return None
    return OutputTruncatedError(completion_tokens, completion_tokens, "the forced tool call")


def cut_forced_call(completion: Completion) -> OutputTruncatedError | None:
    """``cut_call`` for an engine completion."""
    return cut_call(completion.finish_reason.value, len(completion.tool_calls),
                    len(completion.invalid_tool_calls), completion.usage.completion_tokens)
