"""Anthropic's messages as the engine's chat messages, and where each one came from.

The Messages API spells a conversation differently from OpenAI's: the system prompt is a
field of its own, a user turn carries its tool results as ``tool_result`` blocks, an
assistant turn its calls as ``tool_use`` blocks and its past reasoning as ``thinking``
blocks. ``chat_messages`` rewrites them into the OpenAI-shaped dicts the engine's one
rulebook (``engine.messages_from_openai``) reads, so what may be said, and every refusal,
is the rulebook's as at every other door:

- ``system`` (a string or text blocks) and ``role: "system"`` messages -> system messages;
- a user turn's ``tool_result`` blocks -> ``tool`` messages (their text and images as the
  content; the tool's name from the ``tool_use`` it answers), its other blocks -> a user
  message, in the order they came;
- ``image`` blocks (``source`` base64 or a ``url``) -> the rulebook's image part (a remote
  URL is refused there: the engine fetches nothing);
- an assistant turn's ``tool_use`` blocks -> its ``tool_calls``; ``thinking`` blocks -> its
  reasoning (``reasoning_content``: templates that render past thinking show it);
  ``redacted_thinking`` (opaque, Anthropic's encryption) is dropped.

Any other block goes to the rulebook as it is, which refuses it naming its type. A refusal
names the chat field it read (``messages[3].content[0]``); ``MessageFields`` maps it back
to the field the client sent (``messages[1].content[2].content[0]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import IMAGE_PARTS
from mlx_providers.server.errors import APIError


@dataclass
class Origin:
    """Where one chat message came from in the Anthropic request."""

    at: str  # the message or block ("messages[2]", "messages[2].content[0]", "system")
    content: str  # the field its content came from
    parts: list[int] | None = None  # per content part passed on: its index in ``content``
    calls: list[str] = field(default_factory=list)  # per tool call: the tool_use block


@dataclass
class MessageFields:
    """The Anthropic request field behind each field the rulebook names."""

    origins: list[Origin] = field(default_factory=list)

    def anthropic_field(self, name: str) -> str:
        """``messages[3].content[0]`` (a chat message's) as the client's own field."""
        if name == "stop":  # SamplingParams' name
            return "stop_sequences"
        tool = _TOOL_FIELD.fullmatch(name)
        if tool is not None:  # tools go to the engine flat, with OpenAI's "parameters"
            return tool.group(1) + re.sub(r"^\.parameters", ".input_schema", tool.group(2))
        found = _MESSAGE_FIELD.fullmatch(name)
        if found is None:
            return name
        index, rest = int(found.group(1)), found.group(2)
        if index >= len(self.origins):
            return "messages"
        origin = self.origins[index]
        if rest == ".content":
            return origin.content
        part = _PART_FIELD.fullmatch(rest)
        if part is not None:
            k, tail = int(part.group(1)), part.group(2)
            parts = origin.parts
            if parts is None or k >= len(parts):
                return origin.content
            return f"{origin.content}[{parts[k]}]{tail}"
        call = _CALL_FIELD.fullmatch(rest)
        if call is not None:
            j, tail = int(call.group(1)), call.group(2)
            if j >= len(origin.calls):
                return origin.at
            return origin.calls[j] + _CALL_NAMES.get(tail, tail)
        if rest == ".tool_call_id":
            return origin.at + ".tool_use_id"
        return origin.at + rest


_TOOL_FIELD = re.compile(r"(tools\[\d+\])(.*)")
_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\](.*)")
_PART_FIELD = re.compile(r"\.content\[(\d+)\](.*)")
_CALL_FIELD = re.compile(r"\.tool_calls\[(\d+)\](?:\.function)?(.*)")
# A call's fields as a tool_use block spells them.
_CALL_NAMES = {".arguments": ".input"}


def chat_messages(system: str | Sequence[Mapping[str, Any]] | None,
                  messages: Sequence[Mapping[str, Any]],
                  ) -> tuple[list[dict[str, Any]], MessageFields]:
    """The rulebook's chat messages for an Anthropic request, and where each came from.

    ``messages`` have been validated to a role and content (a string or a list of block
    dicts); a malformed block is a 400 naming it.
    """
    out: list[dict[str, Any]] = []
    fields = MessageFields()
    if system:
        content, parts = _texts(system, "system")
        out.append({"role": "system", "content": content})
        fields.origins.append(Origin("system", "system", parts))
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer it
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        role, content = message["role"], message["content"]
        if role == "system":
            text, parts = _texts(content, f"{at}.content")
            out.append({"role": "system", "content": text})
            fields.origins.append(Origin(at, f"{at}.content", parts))
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
            fields.origins.append(Origin(at, f"{at}.content"))
        elif role == "assistant":
            out.append(_assistant(content, at, fields, names))
        else:
            _user(content, at, out, fields, names)
    return out, fields


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any block (or a tool result's block) is an image: decoding one is work for
    a worker thread, not the event loop."""
    for message in messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, Mapping):
                continue
            if block.get("type") in IMAGE_PARTS:
                return True
            inner = block.get("content") if block.get("type") == "tool_result" else None
            if isinstance(inner, list) and any(
                    isinstance(b, Mapping) and b.get("type") in IMAGE_PARTS for b in inner):
                return True
    return False


def _texts(content: Any, at: str) -> tuple[str | list[Any], list[int] | None]:
    """A system prompt: a string, or text blocks passed to the rulebook as text parts."""
    if isinstance(content, str):
        return content, None
    return [_part(block, f"{at}[{k}]") for k, block in enumerate(content)], list(
        range(len(content)))


def _user(content: Sequence[Any], at: str, out: list[dict[str, Any]],
          fields: MessageFields, names: Mapping[str, str]) -> None:
    """A user turn's blocks: each run of tool results as tool messages, each run of other
    blocks as one user message, in order."""
    run: list[Any] = []
    kept: list[int] = []

    def flush() -> None:
        if run:
            out.append({"role": "user", "content": list(run)})
            fields.origins.append(Origin(at, f"{at}.content", list(kept)))
            run.clear()
            kept.clear()

    for k, block in enumerate(content):
        where = f"{at}.content[{k}]"
        if isinstance(block, Mapping) and block.get("type") == "tool_result":
            flush()
            call_id = _text(block, "tool_use_id", where)
            result, parts = _result_content(block.get("content"), f"{where}.content")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "name": names.get(call_id, ""), "content": result})
            fields.origins.append(Origin(where, f"{where}.content", parts))
        else:
            run.append(_part(block, where))
            kept.append(k)
    flush()
    if not content:  # an empty turn is still a turn (the rulebook decides what it means)
        out.append({"role": "user", "content": ""})
        fields.origins.append(Origin(at, f"{at}.content"))


def _assistant(content: Sequence[Any], at: str, fields: MessageFields,
               names: dict[str, str]) -> dict[str, Any]:
    """An assistant turn: its text and thinking blocks as content parts, its tool_use
    blocks as calls."""
    parts: list[Any] = []
    kept: list[int] = []
    calls: list[dict[str, Any]] = []
    origin = Origin(at, f"{at}.content", kept)
    for k, block in enumerate(content):
        where = f"{at}.content[{k}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_use":
            call_id, name = _text(block, "id", where), _text(block, "name", where)
            names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": block.get("input")}})
            origin.calls.append(where)
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic for its own models: nothing to replay
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise _refused(f"{where}.thinking", "a thinking block needs its text as "
                               "'thinking' (a str)")
            parts.append({"type": "thinking", "thinking": thought})
            kept.append(k)
        else:
            parts.append(_part(block, where))
            kept.append(k)
    message: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        message["tool_calls"] = calls
    fields.origins.append(origin)
    return message


def _result_content(content: Any, at: str) -> tuple[str | list[Any], list[int] | None]:
    """A tool result's content: a string, or its blocks (text and images) as parts."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise _refused(at, "a tool result's content is a string or a list of blocks, got "
                       f"{type(content).__name__}")
    return [_part(block, f"{at}[{k}]") for k, block in enumerate(content)], list(
        range(len(content)))


def _part(block: Any, at: str) -> Any:
    """A content block as the rulebook's part: text as a text part, an image as its image
    part; anything else as it is (the rulebook refuses what it does not read)."""
    if not isinstance(block, Mapping):
        return block
    if block.get("type") == "text":
        return {"type": "text", "text": block.get("text")}
    if block.get("type") == "image":
        return _image(block, at)
    return dict(block)


def _image(block: Mapping[str, Any], at: str) -> dict[str, Any]:
    """An image block's source as the rulebook's ``image`` part (base64, or a URL)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise _refused(f"{at}.source", "an image block needs a source: {'type': 'base64', "
                       "'media_type', 'data'} or {'type': 'url', 'url'}")
    kind = source.get("type")
    if kind == "base64":
        return {"type": "image", "base64": _text(source, "data", f"{at}.source"),
                "mime_type": source.get("media_type") or "image/png"}
    if kind == "url":
        return {"type": "image", "url": _text(source, "url", f"{at}.source")}
    if kind == "file":
        raise _refused(f"{at}.source", "images by file_id cannot be read here (this server "
                       "keeps no files): send the image as base64")
    raise _refused(f"{at}.source.type", f"an image source is 'base64' or 'url', got "
                   f"{kind!r:.40}")


def _text(block: Mapping[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise _refused(f"{at}.{key}", f"a non-empty str is required, got {value!r:.40}")
    return value


def _refused(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")
