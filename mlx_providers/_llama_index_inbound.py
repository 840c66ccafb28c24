"""LlamaIndex's chat history as the engine's messages (pure, no model): each ``ChatMessage``
in OpenAI's wire shape (text and citation blocks as text, images as image parts, other media
named for the rulebook to refuse, past calls and reasoning replayed), converted once by the
engine's rulebook (``engine.messages_from_openai``, which decodes the images:
``carries_images`` says when that is worth a worker thread).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    CitableBlock,
    CitationBlock,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    VideoBlock,
)

from engine import InvalidRequestError, Message, messages_from_openai
from mlx_providers._llama_index_tools import legacy_call, tool_call_dict

# Media blocks as OpenAI content-part types: images, videos and audio are read
# (``image_part``, ``video_part``, ``audio_part``), the rest the engine's rulebook refuses.
_MEDIA: dict[type, str] = {ImageBlock: "image_url", AudioBlock: "input_audio", VideoBlock: "video",
          DocumentBlock: "file"}
# LlamaIndex's own names for the assistant's role (other integrations' histories).
_ROLES = {MessageRole.CHATBOT.value: "assistant", MessageRole.MODEL.value: "assistant"}


def _blocks_text(blocks: Iterable[Any]) -> str:
    """The text of a message's text blocks (citations included), joined by newlines."""
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, CitableBlock):
            parts.append(_blocks_text(block.content))
        elif isinstance(block, CitationBlock):
            parts.append(_blocks_text([block.cited_content]))
        # Thinking, tool-call and cache-point blocks carry no content text: calls are
        # rendered from tool_calls, and past reasoning from reasoning_content
        # (``past_reasoning``), where the template puts it.
    return "\n".join(parts)


def image_part(block: ImageBlock) -> dict[str, Any]:
    """An ``ImageBlock`` as an image part: its bytes, its local ``path`` (read here: the
    caller named a file on this machine) or a data URL. A remote URL is passed as one, which
    the engine refuses: it fetches nothing."""
    url = str(block.url) if block.url is not None else None
    if url is not None:
        return {"type": "image_url", "image_url": {"url": url}}
    mime = block.image_mimetype or "image/png"
    if isinstance(block.image, bytes) and block.image.isascii():
        # ImageBlock keeps its bytes base64-encoded: passed on as they are (resolving them
        # decodes and encodes them again, holding the GIL ~0.6 s for a 12 MP PNG).
        return {"type": "image", "base64": block.image.decode("ascii"), "mime_type": mime}
    try:
        data = block.resolve_image(as_base64=False).read()
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"ImageBlock: the image cannot be read ({exc})",
                                  "ImageBlock") from exc
    return {"type": "image", "base64": _base64_text(data), "mime_type": mime}


def video_part(block: VideoBlock) -> dict[str, Any]:
    """A ``VideoBlock`` as a video part: its bytes, its local ``path`` (read here) or a
    data URL; a remote URL is passed as one, which the engine refuses."""
    if block.url is not None:
        return {"type": "video_url", "video_url": {"url": str(block.url)}}
    mime = block.video_mimetype or "video/mp4"
    try:
        data = block.resolve_video(as_base64=False).read()
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"VideoBlock: the video cannot be read ({exc})",
                                  "VideoBlock") from exc
    return {"type": "video", "base64": _base64_text(data), "mime_type": mime}


def audio_part(block: AudioBlock) -> dict[str, Any]:
    """An ``AudioBlock`` as an audio part: its bytes or local ``path`` (read here), or a data
    URL; a remote URL is passed as one, which the engine refuses."""
    if block.url is not None:
        return {"type": "audio", "url": str(block.url)}
    try:
        data = block.resolve_audio(as_base64=False).read()
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"AudioBlock: the audio cannot be read ({exc})",
                                  "AudioBlock") from exc
    kind = block.format or "wav"
    return {"type": "audio", "base64": _base64_text(data), "mime_type": f"audio/{kind}"}


# Bytes base64-encoded at a time (a multiple of 3): CPython's encoder holds the GIL
# throughout, which would stall the caller's event loop while a worker converts.
_B64_PIECE = 3 << 18


def _base64_text(data: bytes) -> str:
    """``base64.b64encode(data)`` as text, a piece at a time."""
    return "".join(base64.b64encode(data[i:i + _B64_PIECE]).decode("ascii")
                   for i in range(0, len(data), _B64_PIECE))


def _content(blocks: Sequence[Any]) -> str | list[Any]:
    """A message's content: its text, or parts with each media block as an OpenAI part:
    an image as an image part, any other medium named
    (``{"type": "input_audio", "block": "AudioBlock"}``) for the rulebook to refuse."""
    if not any(isinstance(b, tuple(_MEDIA)) for b in blocks):
        return _blocks_text(blocks)
    parts: list[Any] = []
    text: list[Any] = []
    for block in blocks:
        if isinstance(block, tuple(_MEDIA)):
            if text:
                parts.append(_blocks_text(text))
                text = []
            parts.append(image_part(block) if isinstance(block, ImageBlock) else
                         video_part(block) if isinstance(block, VideoBlock) else
                         audio_part(block) if isinstance(block, AudioBlock) else
                         {"type": _MEDIA[type(block)], "block": type(block).__name__})
        else:
            text.append(block)
    return [*parts, *([_blocks_text(text)] if text else [])]


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's tool calls, from ToolCallBlocks or legacy additional_kwargs."""
    calls = [tool_call_dict(b.tool_call_id, b.tool_name, b.tool_kwargs)
             for b in message.blocks if isinstance(b, ToolCallBlock)]
    seen = {c["id"] for c in calls if c["id"]}
    for raw in message.additional_kwargs.get("tool_calls") or ():
        call = legacy_call(raw)
        if call is not None and (not call["id"] or call["id"] not in seen):
            calls.append(call)
    return calls


# Where a history may keep an assistant turn's reasoning in additional_kwargs: the two
# names OpenAI-compatible servers send it under (``reasoning_content``, and vLLM's
# ``reasoning``, which this LLM's completions carry too). llama-index-llms-openai(-like)
# itself returns a ThinkingBlock.
_REASONING_KEYS = ("reasoning_content", "reasoning")


def past_reasoning(message: ChatMessage) -> str:
    """An assistant turn's reasoning, to replay: the text of its ``ThinkingBlock``s (what
    this LLM returns; several are joined by newlines), else a ``reasoning_content`` /
    ``reasoning`` str in its additional_kwargs; "" when it has none."""
    thinking = [b.content for b in message.blocks if isinstance(b, ThinkingBlock) and b.content]
    if thinking:
        return "\n".join(thinking)
    for key in _REASONING_KEYS:
        kept = message.additional_kwargs.get(key)
        if isinstance(kept, str) and kept:
            return kept
    return ""


def carries_images(messages: Any) -> bool:
    """Whether a chat history holds an image, video or audio block: converting it reads (a
    ``path``) and decodes or probes the media, work the async paths hand to a worker
    thread."""
    return isinstance(messages, Iterable) and any(
        isinstance(block, ImageBlock | VideoBlock | AudioBlock) for message in messages
        if isinstance(message, ChatMessage) for block in message.blocks)


def to_engine_messages(messages: Sequence[ChatMessage]) -> tuple[Message, ...]:
    """LlamaIndex chat history as the engine's messages, converted once by its rulebook
    (``engine.messages_from_openai``); a failed tool result says so in its text."""
    if isinstance(messages, (str, bytes, Mapping, ChatMessage)) or not isinstance(
            messages, Iterable):
        raise TypeError(f"messages must be a list of llama_index ChatMessage, got "
                        f"{type(messages).__name__} {messages!r:.40}")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> tool name, so results can name their tool
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            # A dict here used to fail deep inside as AttributeError: 'dict' has no 'role'.
            raise TypeError(f"messages[{i}] must be a llama_index ChatMessage (e.g. "
                            f"ChatMessage(role='user', content='...')), got "
                            f"{type(message).__name__} {message!r:.40}")
        role = message.role.value if isinstance(message.role, MessageRole) else message.role
        role = _ROLES.get(role, role)
        item: dict[str, Any] = {"role": role, "content": _content(message.blocks)}
        extra = message.additional_kwargs
        if role == MessageRole.ASSISTANT.value:
            calls = _calls_of(message)
            if calls:
                item["tool_calls"] = calls
                names.update({c["id"]: c["function"]["name"] for c in calls if c["id"]})
            reasoning = past_reasoning(message)
            if reasoning:  # templates that take it (Qwen3's) render it back; others ignore it
                item["reasoning_content"] = reasoning
        elif role in (MessageRole.TOOL.value, MessageRole.FUNCTION.value):
            call_id = extra.get("tool_call_id")
            if call_id:
                item["tool_call_id"] = call_id
            name = extra.get("name") or extra.get("tool_name") or names.get(call_id or "")
            if name:
                item["name"] = name
        out.append(item)
    try:
        converted = messages_from_openai(out)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{exc}{_block_note(out, exc.field)}", exc.field) from exc
    return tuple(
        replace(m, content=f"Error: {m.content}")
        if m.role == "tool" and li.additional_kwargs.get("is_error")
        and not m.content.startswith("Error") else m
        for li, m in zip(messages, converted, strict=True))


def _block_note(out: list[dict[str, Any]], field: str) -> str:
    """Which LlamaIndex block a refused content part was, for the error message."""
    found = re.fullmatch(r"messages\[(\d+)\]\.content\[(\d+)\]\.type", field)
    if found is None:
        return ""
    part = out[int(found.group(1))]["content"][int(found.group(2))]
    block = part.get("block") if isinstance(part, Mapping) else None
    return f" (MLXBatchLLM reads text and image blocks; got a {block})" if block else ""
