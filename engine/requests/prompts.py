"""Turning a request's prompt into token ids with the model's tokenizer and chat template.

Chat messages are rendered with ``add_generation_prompt=True``; tools go through the
template's ``tools=`` when it renders them, otherwise into the system message. Also
knows the tokenizer's text markers for reasoning and tool calls. No model, no mlx.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.requests.channels import CONTENT, REASONING, TOOL
from engine.requests.request import ChatMessage, Prompt
from engine.requests.tool_formats import ToolFormat, detect_tool_format
from engine.requests.tools import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolSpec,
    with_fallback_tool_prompt,
)

# Roles chat templates know (OpenAI's, with the legacy "function" result role).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_RESULT_ROLES = frozenset({"tool", "function"})
_MAX_TOKEN_ID = 2**31 - 1  # mlx holds token ids as 32-bit integers
_PROMPT_KINDS = "text, a list of token ids, or a list of chat messages (dicts)"


def checked_prompt(prompt: Any) -> str | list[int] | list[ChatMessage]:
    """``submit``'s prompt, checked at the door on the caller's thread, as a private copy.

    Text stays text. Token ids must be integers (numpy's too, never bools or floats) in
    [0, 2**31); whether they are inside this model's vocabulary is checked when the
    request is prepared. Chat messages are checked by ``checked_message``. The copy means a
    caller that changes its list after ``submit`` changes nothing queued.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        return prompt
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Iterable):
        hint = " (one message? pass a list of messages)" if isinstance(prompt, Mapping) else ""
        raise TypeError(f"prompt must be {_PROMPT_KINDS}, got {type(prompt).__name__}{hint}")
    items = list(prompt)
    if not items:
        raise ValueError("prompt is empty: give at least one token or message")
    if isinstance(items[0], Mapping):
        return [checked_message(m, f"prompt[{i}]") for i, m in enumerate(items)]
    return [_token_id(t, i) for i, t in enumerate(items)]


def _token_id(value: Any, i: int) -> int:
    if isinstance(value, Mapping):
        raise TypeError(f"prompt[{i}] is a dict after token ids: a prompt is {_PROMPT_KINDS}, "
                        "not a mix")
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"prompt[{i}] must be an integer token id, got "
                        f"{type(value).__name__} {value!r:.40}")
    token = operator.index(value)
    if not 0 <= token <= _MAX_TOKEN_ID:
        raise ValueError(f"prompt token ids out of range [0, 2**31): prompt[{i}] = {token}")
    return token


def checked_message(message: Any, at: str) -> ChatMessage:
    """One chat message as a template-safe copy; raises naming ``at`` and the field.

    A known role; text content (or OpenAI text parts, joined; None or absent only on an
    assistant turn); an assistant's ``tool_calls`` as OpenAI calls whose arguments are a
    JSON object; a tool result's ``tool_call_id`` and ``name`` as text. Other keys are the
    template's business and pass through.
    """
    if not isinstance(message, Mapping):
        raise TypeError(f"{at} must be a chat message dict (after other messages), got "
                        f"{type(message).__name__} {message!r:.40}")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise ValueError(f"{at}.role must be one of {sorted(CHAT_ROLES)}, got {role!r:.40}")
    out = dict(message)
    if "content" in message or role != "assistant":
        out["content"] = _content_text(message.get("content"), f"{at}.content",
                                       optional=role == "assistant")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise TypeError(f"{at}.{key} must be a str, got {type(message[key]).__name__}")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{at}.tool_calls: only assistant messages make tool calls "
                             f"(role is {role!r})")
        if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Iterable):
            raise TypeError(f"{at}.tool_calls must be a list of calls, got "
                            f"{type(calls).__name__}")
        out["tool_calls"] = [_checked_call(c, f"{at}.tool_calls[{j}]")
                             for j, c in enumerate(calls)]
    return out


def _content_text(content: Any, at: str, optional: bool) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if optional:
            return None
        raise TypeError(f"{at} must be text (a str or a list of text parts), got None")
    if isinstance(content, (bytes, bytearray, Mapping)) or not isinstance(content, Iterable):
        raise TypeError(f"{at} must be text (a str or a list of text parts), got "
                        f"{type(content).__name__} {content!r:.40}")
    texts: list[str] = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(text, str):
            what = f"a {kind!r} part" if isinstance(kind, str) else type(part).__name__
            raise ValueError(f"{at}[{k}] must be a text part {{'type': 'text', 'text': str}} "
                             f"(text-only models), got {what}")
        texts.append(text)
    return "".join(texts)


def _checked_call(call: Any, at: str) -> dict[str, Any]:
    """An assistant's tool call: {"function": {"name", "arguments"}} (or that dict flat)."""
    if not isinstance(call, Mapping):
        raise TypeError(f"{at} must be a tool call dict, got {type(call).__name__}")
    fn = call.get("function", call)
    where = f"{at}.function" if "function" in call else at
    if not isinstance(fn, Mapping):
        raise TypeError(f"{where} must be a dict with name and arguments, got "
                        f"{type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty str, got {name!r:.40}")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise TypeError(f"{at}.id must be a str, got {type(call['id']).__name__}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ValueError(f"{where}.arguments is not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}.arguments must be a JSON object, got {arguments!r:.40}")
    elif not isinstance(arguments, Mapping):
        raise TypeError(f"{where}.arguments must be a dict or the JSON text of one, got "
                        f"{type(arguments).__name__}")
    return dict(call)


@dataclass(frozen=True)
class EncodedPrompt:
    """A request's prompt as the engine needs it."""

    ids: list[int]
    start_channel: str = CONTENT
    head_len: int = 0


class PromptRenderer:
    """Encodes prompts for one tokenizer (mlx-lm's TokenizerWrapper)."""

    def __init__(self, tokenizer: Any, model_path: Path, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._renders_tools: bool | None = None

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (rendered with the chat template) -> ids."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.render_chat(list(prompt))  # type: ignore[arg-type]
        else:
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def encode_request(
        self, prompt: Prompt, tools: Sequence[ToolSpec], template_kwargs: dict[str, Any]
    ) -> EncodedPrompt:
        """Token ids for a request, the channel its output starts in, and its shared head.

        Tools are rendered by the chat template when it knows how; otherwise they are
        described in the system message: in the family's trained format where it is known
        (``engine.requests.tool_formats``), else
        ``engine.requests.tools.fallback_tool_prompt``. The head
        is the leading system message(s) with the tools: what parallel agent branches
        share, and what the prefix cache stores on its own.
        """
        if not (prompt and not isinstance(prompt, str)
                and all(isinstance(m, dict) for m in prompt)):
            return EncodedPrompt(self.encode(prompt))
        messages: list[ChatMessage] = list(prompt)  # type: ignore[arg-type]
        kwargs = dict(template_kwargs)
        if tools:
            if self.template_renders_tools():
                kwargs["tools"] = [t.as_openai() for t in tools]
            elif (family := self.tool_format()) is not None:
                messages = family.rewrite(messages, tools)
            else:
                messages = with_fallback_tool_prompt(messages, tools)
        text = self.chat_text(messages, **kwargs)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        think = self.tokenizer.think_start if self.tokenizer.has_thinking else None
        # Templates that open the thinking block themselves start the output inside it.
        starts_thinking = bool(think) and text.rstrip().endswith(str(think))
        return EncodedPrompt(ids, REASONING if starts_thinking else CONTENT,
                             self._head_length(messages, ids, kwargs))

    def _head_length(self, messages: list[ChatMessage], ids: list[int],
                     kwargs: dict[str, Any]) -> int:
        leading = 0
        while leading < len(messages) and messages[leading].get("role") == "system":
            leading += 1
        if not leading or leading == len(messages):
            return 0
        try:
            text = str(self.tokenizer.apply_chat_template(
                messages[:leading], add_generation_prompt=False, tokenize=False, **kwargs))
        except Exception:  # a template that refuses a system-only chat: no head
            return 0
        head = list(self.tokenizer.encode(text, add_special_tokens=False))
        # Only a true token prefix of the whole prompt can be reused as one.
        return len(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else 0

    def template_renders_tools(self) -> bool:
        """Whether the chat template shows tools passed as ``tools=`` (probed once)."""
        if self._renders_tools is None:
            probe = ToolSpec("zz_probe_tool_zz", "probe")
            message = [{"role": "user", "content": "hi"}]
            try:
                text = self.chat_text(message, tools=[probe.as_openai()])
                self._renders_tools = probe.name in text
            except Exception:  # a template that chokes on tools cannot render them
                self._renders_tools = False
        return self._renders_tools

    def tool_format(self) -> ToolFormat | None:
        """The model family's known tool format, for templates that render no tools."""
        template = getattr(self.tokenizer, "chat_template", None)
        return detect_tool_format(template if isinstance(template, str) else None)

    def channel_markers(self) -> dict[str, tuple[str, str]]:
        """Text markers of reasoning and tool calls for this tokenizer."""
        tokenizer = self.tokenizer
        markers = {TOOL: (TOOL_CALL_START, TOOL_CALL_END)}
        if tokenizer.has_tool_calling:
            markers[TOOL] = (tokenizer.tool_call_start, tokenizer.tool_call_end)
        if tokenizer.has_thinking:
            markers[REASONING] = (tokenizer.think_start, tokenizer.think_end)
        return markers

    @property
    def tool_parser(self) -> Any:
        return self.tokenizer.tool_parser if self.tokenizer.has_tool_calling else None

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(self.chat_text(messages, **template_kwargs),
                                          add_special_tokens=False))

    def chat_text(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"the model at {self.model_path} has no chat template; pass text or token ids"
            )
        return str(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        ))

