"""Tools in the prompt for chat templates that do not render them: the tagged-JSON listing,
or a known model family's trained format.

When a chat template ignores ``tools=``, the engine describes the tools in the system
message. For families whose published tool format is known, that description is the
family's own, and past tool calls and results are rewritten into the family's format,
since such a template cannot render them. Otherwise the tagged-JSON fallback
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is described. Which formats
are known is each dialect's declaration (``Dialect.tool_formats``). No mlx.

Defined here, as the default dialect's: SmolLM2 (HuggingFaceTB's 135M/360M/1.7B Instruct
models). Its template carries the default system prompt "You are a helpful AI assistant
named SmolLM, trained by Hugging Face"; its tool format is the one in Ollama's smollm2
template: the calls as a JSON list inside one ``<tool_call>...</tool_call>``, results as a
user turn in ``<tool_response>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.requests.inbound.tool_specs import ToolSpec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def fallback_tool_prompt(tools: Sequence[ToolSpec]) -> str:
    """System-prompt text for chat templates that do not render tools themselves."""
    listing = "\n".join(json.dumps(t.as_openai()) for t in tools)
    return (
        "You have access to the following tools:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a tool, reply with one line per call in exactly this format:\n"
        f'{TOOL_CALL_START}{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}'
        f"{TOOL_CALL_END}\n"
        "Otherwise reply normally."
    )


def with_fallback_tool_prompt(messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Messages with the tool listing merged into (or prepended as) the system message."""
    text = fallback_tool_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def has_tool_history(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether past tool calls or results are among the messages."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def with_plain_tool_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Past calls and results as plain text, for templates that drop tool messages
    (Phi-3.5's renders only system, user and assistant text): each assistant turn's calls
    as tagged-JSON lines in its content, as the fallback tool prompt asks calls to be
    written, and each run of tool results as one user turn of ``<tool_response>`` blocks
    (one turn, as templates that insist on alternating roles want)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            lines = [f"{TOOL_CALL_START}{json.dumps(_call_object(c))}{TOOL_CALL_END}"
                     for c in message["tool_calls"]]
            text = str(message.get("content") or "").strip()
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": "\n".join([text, *lines] if text else lines)})
        elif role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("tool_results", None)  # only marked runs of results while joining
    return out


@dataclass(frozen=True)
class ToolFormat:
    """How one model family was trained to see tools, tool calls and tool results."""

    name: str
    marker: str  # text in the chat template that identifies the family
    system_prompt: Callable[[Sequence[ToolSpec]], str]
    render_calls: Callable[[Sequence[Mapping[str, Any]]], str]
    render_result: Callable[[str], str]

    def rewrite(self, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
        """Messages with the family's tool system prompt and plain-text tool history."""
        prompt = self.system_prompt(tools)
        out: list[dict[str, Any]] = []
        rest = list(messages)
        if rest and rest[0].get("role") == "system":
            user_system = str(rest.pop(0).get("content") or "").strip()
            if user_system:
                prompt = f"{prompt}\n\n{user_system}"
        out.append({"role": "system", "content": prompt})
        for message in rest:
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                text = str(message.get("content") or "").strip()
                calls = self.render_calls(message["tool_calls"])
                out.append({"role": "assistant",
                            "content": f"{text}\n{calls}" if text else calls})
            elif role == "tool":
                out.append({"role": "user",
                            "content": self.render_result(str(message.get("content") or ""))})
            else:
                out.append(dict(message))
        return out


def _call_object(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call in OpenAI shape (``function``: name, arguments) or flat -> name/arguments."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": arguments}


def _smollm2_system(tools: Sequence[ToolSpec]) -> str:
    listing = json.dumps([t.as_openai() for t in tools])
    return (
        "You are an expert in composing functions. You are given a question and a set of "
        "possible functions.\n"
        "Based on the question, you will need to make one or more function/tool calls to "
        "achieve the purpose.\n"
        "If none of the functions can be used, point it out and refuse to answer.\n"
        "If the given question lacks the parameters required by the function, also point "
        "it out.\n"
        "You have access to the following tools:\n"
        f"<tools>{listing}</tools>\n"
        "The output MUST strictly adhere to the following format, and NO other text MUST "
        "be included.\n"
        "The example format is as follows. Please make sure the parameter type is correct. "
        "If no function call is needed, please make the tool calls an empty list '[]'.\n"
        f"{TOOL_CALL_START}[\n"
        '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
        "(more tool calls as required)\n"
        f"]{TOOL_CALL_END}"
    )


def _smollm2_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    body = ",\n".join(json.dumps(_call_object(c)) for c in calls)
    return f"{TOOL_CALL_START}[\n{body}\n]{TOOL_CALL_END}"


def _smollm2_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


SMOLLM2 = ToolFormat(
    name="smollm2",
    marker="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    system_prompt=_smollm2_system,
    render_calls=_smollm2_calls,
    render_result=_smollm2_result,
)


def detect_tool_format(chat_template: str | None,
                       formats: Sequence[ToolFormat]) -> ToolFormat | None:
    """Of ``formats`` (those a model's dialect declares, ``Dialect.tool_formats``), the one
    whose marker the chat template carries, if any."""
    if not chat_template:
        return None
    for fmt in formats:
        if fmt.marker in chat_template:
            return fmt
    return None
