"""Chat messages as typed values, and THE rulebook that reads them from OpenAI's wire shape.

Every door (``Engine.submit``, LangChain's ``ChatMLXBatch``, LlamaIndex's ``MLXBatchLLM``,
the server's chat completions and Responses) turns its own message types into
``Message`` values through ``messages_from_openai`` exactly once, so what a caller may
send does not depend on the door it uses. The rules:

- roles are OpenAI's six, spelled exactly: ``system``, ``developer`` (a system message),
  ``user``, ``assistant``, ``tool``, ``function`` (legacy, a tool result named by ``name``);
- content is text: a str, or a list of str / text parts (``text``, ``input_text``,
  ``output_text``) and image parts (``image_url``, ``input_image``, ``image``: read by
  ``images``, each standing in the text as ``IMAGE_MARK`` where the model's image tokens
  go); an assistant turn may also hold parts that carry no prompt text
  (reasoning, thinking, refusals, tool-use blocks: calls are read from ``tool_calls``),
  which are dropped; any other part (audio, a file) is refused, naming its
  ``content[k].type``;
- only assistant turns make ``tool_calls``; a call's arguments are a dict or the JSON
  text of an object, anything else (unparsable text included) is refused;
- a ``tool`` message carries its ``tool_call_id`` (OpenAI requires it), a ``function``
  message its ``name``.

Every refusal is an ``InvalidRequestError`` whose ``field`` names the bad field. No mlx.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.requests.inbound.audio import AUDIO_PARTS, DecodedAudio, audio_of_part
from engine.requests.inbound.images import IMAGE_MARK, IMAGE_PARTS, DecodedImage, image_of_part
from engine.requests.inbound.videos import VIDEO_PARTS, DecodedVideo, video_of_part

# What a message's content may carry besides text.
Media = DecodedImage | DecodedVideo | DecodedAudio

# The roles the rulebook accepts, and the role each is rendered as.
ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool", "function": "tool"}
# Content parts whose text is the prompt's.
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
# Parts of an assistant turn that carry no content text: past thinking goes to the turn's
# ``reasoning_content`` (templates that take it render it), calls are rendered from
# ``tool_calls``.
SILENT_ASSISTANT_PARTS = frozenset({"reasoning", "thinking", "redacted_thinking", "refusal",
                                    "tool_use", "tool_call", "function_call"})
# The keys an assistant turn's past reasoning comes under (``reasoning_content`` wins).
REASONING_KEYS = ("reasoning_content", "reasoning")
# Keys a message carries that the rulebook reads; any other key passes to the template.
_KNOWN_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


@dataclass(frozen=True)
class MessageToolCall:
    """One call an assistant turn made: its id (may be empty), tool name and arguments."""

    id: str
    name: str
    arguments: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The call as chat templates read it (arguments as a dict, not JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass(frozen=True)
class Message:
    """One chat message, checked. ``role`` is the rendered role (system, user, assistant
    or tool); ``content`` is its text; ``extra`` holds keys only the template reads."""

    role: str
    content: str = ""
    name: str | None = None
    tool_calls: tuple[MessageToolCall, ...] = ()
    tool_call_id: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Images, videos and audio clips in order, each at an ``IMAGE_MARK`` of content.
    images: tuple[Media, ...] = ()

    def as_openai(self) -> dict[str, Any]:
        """The message as a dict in OpenAI's shape (what chat templates are written for)."""
        out: dict[str, Any] = {**self.extra, "role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def messages_from_openai(messages: Any, root: str = "messages") -> tuple[Message, ...]:
    """THE conversion of OpenAI-shaped chat messages; ``root`` names the argument in errors.

    Already typed messages pass as they are (nothing is normalised twice).
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise InvalidRequestError(f"{root} must be a list of chat messages, got "
                                  f"{type(messages).__name__} {messages!r:.40}", root)
    items = list(messages)
    if not items:
        raise InvalidRequestError(f"{root} is empty: give at least one message", root)
    return tuple(m if isinstance(m, Message) else message_from_openai(m, f"{root}[{i}]")
                 for i, m in enumerate(items))


def message_from_openai(message: Any, at: str) -> Message:
    """One OpenAI chat message as a ``Message``; refusals name ``at`` and the field."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"{at} must be a chat message dict, got "
                                  f"{type(message).__name__} {message!r:.40}", at)
    wire_role = message.get("role")
    if not isinstance(wire_role, str) or wire_role not in ROLES:
        raise InvalidRequestError(f"{at}.role must be one of {sorted(ROLES)}, got "
                                  f"{wire_role!r:.40}", f"{at}.role")
    role = ROLES[wire_role]
    optional = role == "assistant"  # an assistant turn that only calls has no text
    images: list[Media] = []
    content = _content_text(message.get("content"), f"{at}.content", optional, role, images)
    name = _text_field(message, "name", at)
    call_id = _text_field(message, "tool_call_id", at)
    calls = message.get("tool_calls")
    tool_calls: tuple[MessageToolCall, ...] = ()
    if calls is not None:
        if role != "assistant":
            raise InvalidRequestError(f"{at}.tool_calls: only assistant messages make tool "
                                      f"calls (role is {wire_role!r})", f"{at}.tool_calls")
        if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Iterable):
            raise InvalidRequestError(f"{at}.tool_calls must be a list of calls, got "
                                      f"{type(calls).__name__}", f"{at}.tool_calls")
        tool_calls = tuple(_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls))
    if wire_role == "tool" and not call_id:
        raise InvalidRequestError(f"{at}.tool_call_id is required on a tool message: it "
                                  "names the call this is the result of", f"{at}.tool_call_id")
    if wire_role == "function" and not name:
        raise InvalidRequestError(f"{at}.name is required on a function message: it names "
                                  "the function this is the result of", f"{at}.name")
    extra = {k: v for k, v in message.items() if k not in _KNOWN_KEYS}
    _past_reasoning(extra, message.get("content"), at, role)
    return Message(role, content, name, tool_calls, call_id or None, extra, tuple(images))


def _past_reasoning(extra: dict[str, Any], content: Any, at: str, role: str) -> None:
    """An assistant turn's past reasoning as ``reasoning_content`` (the name templates that
    render it, Qwen3's, read): that key, else ``reasoning`` (the other name servers answer
    with), else the text of its reasoning parts. Under either key, on any turn, it is
    text."""
    for key in REASONING_KEYS:
        if key in extra and not isinstance(extra[key], str):
            raise InvalidRequestError(
                f"{at}.{key} must be the turn's reasoning text (a str), got "
                f"{type(extra[key]).__name__}", f"{at}.{key}")
    if role != "assistant":
        return
    if "reasoning" in extra:
        extra.setdefault("reasoning_content", extra.pop("reasoning"))
    if "reasoning_content" not in extra:
        thought = _parts_reasoning(content)
        if thought:
            extra["reasoning_content"] = thought


def _parts_reasoning(content: Any) -> str:
    """The text of an assistant turn's reasoning parts (``reasoning``, ``thinking``: their
    ``reasoning``, ``thinking`` or ``text`` string), to replay as its reasoning."""
    if isinstance(content, str | bytes | bytearray | Mapping) or not isinstance(
            content, Iterable):
        return ""
    texts = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in ("reasoning", "thinking"):
            text = next((part[k] for k in ("reasoning", "thinking", "text")
                         if isinstance(part.get(k), str)), "")
            texts.append(text)
    return "".join(texts)


def _text_field(message: Mapping[str, Any], key: str, at: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{at}.{key} must be a str, got {type(value).__name__} "
                                  f"{value!r:.40}", f"{at}.{key}")
    return value


def _content_text(content: Any, at: str, optional: bool, role: str,
                  images: list[Media]) -> str:
    """The content's text; its images, videos and audio are appended to ``images``, each
    marked in the text."""
    if isinstance(content, str):
        return _plain(content, at)
    if content is None:
        if optional:
            return ""
        raise InvalidRequestError(f"{at} must be text (a str or a list of text parts), got "
                                  "None", at)
    if isinstance(content, (bytes, bytearray, Mapping)) or not isinstance(content, Iterable):
        raise InvalidRequestError(f"{at} must be text (a str or a list of text parts), got "
                                  f"{type(content).__name__} {content!r:.40}", at)
    texts: list[str] = []
    for k, part in enumerate(content):
        where = f"{at}[{k}]"
        if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
            images.append(image_of_part(part, where))
            texts.append(IMAGE_MARK)
        elif isinstance(part, Mapping) and part.get("type") in VIDEO_PARTS:
            images.append(video_of_part(part, where))
            texts.append(IMAGE_MARK)
        elif isinstance(part, Mapping) and part.get("type") in AUDIO_PARTS:
            images.append(audio_of_part(part, where))
            texts.append(IMAGE_MARK)
        else:
            texts.append(_plain(part, where) if isinstance(part, str)
                         else _plain(_part_text(part, where, role), where))
    return "".join(texts)


def _plain(text: str, at: str) -> str:
    """Text as given; the image mark is refused in it (it would read as an image)."""
    if IMAGE_MARK in text:
        raise InvalidRequestError(f"{at}: U+FFFC (the object replacement character) cannot "
                                  "be sent as text: it marks where an image goes", at)
    return text


def _part_text(part: Any, at: str, role: str) -> str:
    if not isinstance(part, Mapping):
        raise InvalidRequestError(f"{at} must be a str or a text part {{'type': 'text', "
                                  f"'text': str}}, got {type(part).__name__} {part!r:.40}", at)
    kind = part.get("type", "text")
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{at}.type must be a str, got {type(kind).__name__}",
                                  f"{at}.type")
    if kind in TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{at}.text: a {kind!r} part needs 'text' as a str, got "
                                      f"{type(text).__name__}", f"{at}.text")
        return text
    if role == "assistant" and kind in SILENT_ASSISTANT_PARTS:
        return ""
    raise InvalidRequestError(f"{at}.type: {kind!r:.40} parts are refused: the engine reads "
                              f"text parts ({sorted(TEXT_PARTS)}), image parts "
                              f"({sorted(IMAGE_PARTS)}), video parts "
                              f"({sorted(VIDEO_PARTS)}) and audio parts "
                              f"({sorted(AUDIO_PARTS)})", f"{at}.type")


def _call(call: Any, at: str) -> MessageToolCall:
    """An assistant's call: {"id", "function": {"name", "arguments"}} (or that dict flat)."""
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{at} must be a tool call dict, got "
                                  f"{type(call).__name__}", at)
    fn = call.get("function", call)
    where = f"{at}.function" if "function" in call else at
    if not isinstance(fn, Mapping):
        raise InvalidRequestError(f"{where} must be a dict with name and arguments, got "
                                  f"{type(fn).__name__}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{at}: a tool call needs its tool's name as a non-empty "
                                  f"str ({where}.name), got {name!r:.40}", f"{where}.name")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidRequestError(f"{at}.id must be a str, got {type(call_id).__name__}",
                                  f"{at}.id")
    # "args" is LangChain's spelling of a call's arguments (its ToolCall dicts).
    arguments = fn.get("arguments", fn.get("args"))
    return MessageToolCall(call_id or "", name,
                           arguments_of(arguments, f"{where}.arguments", at))


def arguments_of(arguments: Any, at: str, call: str) -> dict[str, Any]:
    """A call's arguments (field ``at`` of ``call``) as a dict: given as one, or as the
    JSON text of an object."""
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{call}: arguments must be a dict or the JSON text of one "
                                  f"({at}), got {type(arguments).__name__}", at)
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise InvalidRequestError(f"{at} is not JSON: {exc}", at) from exc
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{at}: arguments must be a JSON object, got "
                                  f"{arguments!r:.40}", at)
    return parsed


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as dicts any chat template accepts, whatever history an agent built.

    Templates reject a system message after the first turn, so its text becomes a user
    turn marked ``[system]``; consecutive plain user (or system) turns are joined, since
    several templates insist that roles alternate.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        item = message.as_openai()
        if item["role"] == "system" and out:
            item["role"], item["content"] = "user", f"[system] {item['content']}"
        previous = out[-1] if out else None
        if previous is not None and _mergeable(previous, item):
            previous["content"] = f"{previous['content']}\n\n{item['content']}".strip()
            continue
        out.append(item)
    return out


def _mergeable(previous: Mapping[str, Any], item: Mapping[str, Any]) -> bool:
    keyed = ("tool_calls", "tool_call_id", "name")
    return (previous["role"] == item["role"] and item["role"] in ("user", "system")
            and not any(k in previous or k in item for k in keyed)
            and set(previous) == set(item) == {"role", "content"})
