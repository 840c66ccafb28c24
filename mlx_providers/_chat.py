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


def content_text(content: Any) -> str:
    """Text of a message's content: a string, or a list of parts (non-text parts dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        return str(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if isinstance(content, Iterable):
        return "".join(content_text(part) for part in content)
    return str(content)


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


def _role(message: Mapping[str, Any]) -> str:
    role = str(message.get("role", "user")).lower()
    if role not in _ROLES:
        raise ValueError(f"unsupported chat role {role!r}")
    return _ROLES[role]


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history any template accepts; never raises for shapes agents produce."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = _role(message)
        item: dict[str, Any] = {"role": role, "content": content_text(message.get("content"))}
        if role == "tool":
            if message.get("status") == "error" and not item["content"].startswith("Error"):
                item["content"] = f"Error: {item['content']}"
            for key in ("tool_call_id", "name"):
                if message.get(key):
                    item[key] = message[key]
        elif message.get("name"):
            item["name"] = message["name"]
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [_canonical_call(c) for c in message["tool_calls"]]
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


def _canonical_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    return tool_call_dict(call.get("id"), str(fn.get("name", "")),
                          fn.get("arguments", fn.get("args")))


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
