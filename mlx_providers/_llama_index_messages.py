"""LlamaIndex types <-> the engine's request values and results (no model, no mlx).

Kept apart from ``llama_index.py`` so the LLM class reads as request plumbing only:
here live message conversion in, response and stream-chunk building out, tool schemas
and tool selections.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    ChatResponse,
    CitableBlock,
    CitationBlock,
    CompletionResponse,
    DocumentBlock,
    ImageBlock,
    LogProb,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    VideoBlock,
)
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.llms.llm import ToolSelection

from engine import (
    Completion,
    InvalidRequestError,
    InvalidToolCall,
    JsonSchema,
    Message,
    OutputTruncatedError,
    StreamEvent,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
    messages_from_openai,
    normalize_tools,
)

# Media blocks as OpenAI content-part types: images are read (``image_part``), the rest
# the engine's rulebook refuses by name.
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
                         {"type": _MEDIA[type(block)], "block": type(block).__name__})
        else:
            text.append(block)
    return [*parts, *([_blocks_text(text)] if text else [])]


def tool_call_dict(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's wire shape; its arguments are read by the engine's rulebook."""
    return {"id": call_id or "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's tool calls, from ToolCallBlocks or legacy additional_kwargs."""
    calls = [tool_call_dict(b.tool_call_id, b.tool_name, b.tool_kwargs)
             for b in message.blocks if isinstance(b, ToolCallBlock)]
    seen = {c["id"] for c in calls if c["id"]}
    for raw in message.additional_kwargs.get("tool_calls") or ():
        call = _legacy_call(raw)
        if call is not None and (not call["id"] or call["id"] not in seen):
            calls.append(call)
    return calls


def _legacy_call(raw: Any) -> dict[str, Any] | None:
    """A call kept by other integrations: an OpenAI dict or object, or a ToolSelection."""
    if isinstance(raw, ToolSelection):
        return tool_call_dict(raw.tool_id, raw.tool_name, raw.tool_kwargs)
    if isinstance(raw, Mapping):
        fn = raw.get("function", raw)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not name:
            return None
        return tool_call_dict(raw.get("id"), str(name), fn.get("arguments", fn.get("args")))
    fn = getattr(raw, "function", None)
    name = getattr(fn, "name", None)
    if not name:
        return None
    return tool_call_dict(getattr(raw, "id", None), str(name), getattr(fn, "arguments", None))


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
    """Whether a chat history holds an ``ImageBlock``: converting it reads (a ``path``) and
    decodes the image, work the async paths hand to a worker thread."""
    return isinstance(messages, Iterable) and any(
        isinstance(block, ImageBlock) for message in messages
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


def tool_specs(tools: Iterable[Any]) -> tuple[ToolSpec, ...]:
    """LlamaIndex tools (or OpenAI dicts) as the engine's tool specs, converted once."""
    if isinstance(tools, tuple) and all(isinstance(t, ToolSpec) for t in tools):
        return tools
    return normalize_tools([openai_tool(tool) for tool in tools])


def _block_note(out: list[dict[str, Any]], field: str) -> str:
    """Which LlamaIndex block a refused content part was, for the error message."""
    found = re.fullmatch(r"messages\[(\d+)\]\.content\[(\d+)\]\.type", field)
    if found is None:
        return ""
    part = out[int(found.group(1))]["content"][int(found.group(2))]
    block = part.get("block") if isinstance(part, Mapping) else None
    return f" (MLXBatchLLM reads text and image blocks; got a {block})" if block else ""


def openai_tool(tool: Any) -> dict[str, Any]:
    """A LlamaIndex tool (or an OpenAI tool dict already) in the OpenAI function format."""
    if isinstance(tool, Mapping):
        return dict(tool)
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "to_openai_tool"):
        raise TypeError(f"expected a LlamaIndex tool or an OpenAI tool dict, got {tool!r}")
    return dict(metadata.to_openai_tool(skip_length_check=True))


def usage_dict(usage: Usage) -> dict[str, Any]:
    """Engine usage for LlamaIndex's token counting (``raw["usage"]``): its keys are the
    engine's own (``Usage.as_dict``)."""
    return usage.as_dict()


def _invalid_dict(call: InvalidToolCall) -> dict[str, Any]:
    """An unparsed call as plain JSON data (raw responses get serialised by tracers)."""
    return {"id": call.id, "name": call.name, "raw": call.raw, "error": call.error}


def final_raw(completion: Completion, model_name: str) -> dict[str, Any]:
    """``ChatResponse.raw`` of a finished request: usage, finish reason, unparsed calls."""
    return {"model": model_name,
            "finish_reason": completion.finish_reason.value,
            "usage": usage_dict(completion.usage),
            "invalid_tool_calls": [_invalid_dict(c) for c in completion.invalid_tool_calls],
            "truncated": completion.truncated}


def assistant_message(content: str, reasoning: str | None,
                      tool_calls: Sequence[ToolCall] = ()) -> ChatMessage:
    """The assistant's turn: thinking first, then the answer text, then its tool calls."""
    if tool_calls and not content.strip():
        content = ""  # the newlines between calls are not an answer
    blocks: list[Any] = []
    if reasoning:
        blocks.append(ThinkingBlock(content=reasoning))
    blocks.append(TextBlock(text=content))
    blocks.extend(ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments))
                  for c in tool_calls)
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


# LlamaIndex's logprobs: one list per generated token.
TokenLogProbs = list[list[LogProb]]


def llama_logprobs(openai: Mapping[str, Any] | None) -> TokenLogProbs | None:
    """OpenAI's ``logprobs`` object (``engine.openai_logprobs``) as LlamaIndex's: one list
    per generated token, the chosen token first, then its ``top_logprobs`` alternatives
    (most likely first; none unless asked for). llama-index-llms-openai lists only the
    alternatives, and nothing without them; the chosen token first keeps what was chosen,
    and its logprob, with or without alternatives (``[1:]`` is OpenAI's list)."""
    if openai is None:
        return None
    return [[LogProb(token=entry["token"], logprob=entry["logprob"], bytes=entry["bytes"]),
             *(LogProb(**alternative) for alternative in entry["top_logprobs"])]
            for entry in openai["content"]]


def chat_response(completion: Completion, model_name: str, delta: str | None = None,
                  extra: Mapping[str, Any] | None = None,
                  logprobs: TokenLogProbs | None = None) -> ChatResponse:
    """A whole (or the last streamed) chat response built from the engine's Completion."""
    message = assistant_message(completion.content, completion.reasoning, completion.tool_calls)
    return ChatResponse(message=message, delta=delta, raw=final_raw(completion, model_name),
                        additional_kwargs=dict(extra or {}), logprobs=logprobs)


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The tool calls of an assistant message, each with a distinct ``tool_id``."""
    found: list[ToolSelection] = []
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            found.append(_selection(block.tool_call_id, block.tool_name, block.tool_kwargs))
    if not found:  # histories built by other integrations keep calls in additional_kwargs
        for raw in message.additional_kwargs.get("tool_calls") or ():
            call = _legacy_call(raw)
            if call is not None:
                fn = call["function"]
                found.append(_selection(call["id"], fn["name"], fn["arguments"]))
    return found


def _selection(call_id: str | None, name: str, arguments: Any) -> ToolSelection:
    """A ToolSelection; a call without an id gets a fresh one (agents match results by id)."""
    kwargs = arguments if isinstance(arguments, Mapping) else _arguments(arguments)
    return ToolSelection(tool_id=call_id or f"call_{uuid.uuid4().hex[:24]}",
                         tool_name=name, tool_kwargs=dict(kwargs))


def _arguments(arguments: Any) -> dict[str, Any]:
    """A legacy call's JSON-text arguments; text that is no JSON object is refused."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, got {arguments!r:.40}")
    return value


def keep_first_call(response: ChatResponse) -> ChatResponse:
    """The response with only its first tool call (when parallel calls were not allowed)."""
    message = response.message
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) <= 1:
        return response
    blocks = [b for b in message.blocks if not isinstance(b, ToolCallBlock)] + calls[:1]
    trimmed = message.model_copy(update={"blocks": blocks})
    return response.model_copy(update={"message": trimmed})


# A request's logprobs converter: its tokens' -> OpenAI's object (None unless it asked).
ToOpenAILogprobs = Callable[[Sequence[TokenLogprob] | None], Mapping[str, Any] | None]


class StreamChunks:
    """Turns a request's stream events into LlamaIndex chunks with delta and accumulation.

    Tool calls stream as they are written (a call's name, then its argument fragments): a
    chunk that brings call pieces lists them in ``additional_kwargs["tool_call_deltas"]``
    (OpenAI's delta shape), and its message holds every call whose arguments are whole so
    far as ``ToolCallBlock``s, so an agent reading any chunk's message sees whole calls only.
    Logprobs, when asked for, accumulate as the text does: each chunk's ``logprobs`` are
    every token's so far (the last chunk's equal the whole response's); a chunk's new ones
    are those past the previous chunk's (a token whose text is held back for a stop
    string, or is call markup, comes on a chunk with an empty ``delta``).
    """

    def __init__(self, model_name: str,
                 check: Callable[[Completion], Completion] | None = None,
                 logprobs: ToOpenAILogprobs | None = None) -> None:
        """Start with nothing accumulated; ``model_name`` goes into the last chunk's raw;
        ``check`` sees the finished completion first (it raises for a cut forced call);
        ``logprobs`` converts an event's logprobs (None: none were asked for)."""
        self.model_name = model_name
        self.check = check
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, Any]] = {}  # index -> id, name, arguments text
        self.convert = logprobs
        self.logprobs: TokenLogProbs | None = None  # so far; stays None unless asked

    def chat(self, event: StreamEvent) -> ChatResponse | None:
        """The chat chunk for ``event``; None for events with nothing to show (call markup)."""
        extra: dict[str, Any] = {"thinking_delta": event.reasoning} if event.reasoning else {}
        if event.tool_call_deltas:
            extra["tool_call_deltas"] = [delta_dict(d) for d in event.tool_call_deltas]
        new_logprobs = self._add_logprobs(event)
        if event.completion is not None:  # the last event: the whole turn, calls and usage
            completion = self.check(event.completion) if self.check else event.completion
            return chat_response(completion, self.model_name, event.content, extra,
                                 self.logprobs)
        if not self._feed(event) and not new_logprobs:
            return None
        message = assistant_message(self.content, self.reasoning or None, self._calls())
        return ChatResponse(message=message, delta=event.content, additional_kwargs=extra,
                            logprobs=self.logprobs)

    def _calls(self) -> list[ToolCall]:
        """The calls streamed so far whose arguments are whole (JSON that parses)."""
        whole: list[ToolCall] = []
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"])
            except ValueError:
                continue  # pieces of a call still streaming
            if isinstance(arguments, dict):
                whole.append(ToolCall(call["id"], call["name"], arguments))
        return whole

    def completion(self, event: StreamEvent) -> CompletionResponse | None:
        """The completion chunk for ``event``; None when it adds no text."""
        extra = {"thinking_delta": event.reasoning} if event.reasoning else {}
        new_logprobs = self._add_logprobs(event)
        if event.completion is not None:
            return completion_response(event.completion, self.model_name, event.content, extra,
                                       self.logprobs)
        if not self._feed(event) and not new_logprobs:
            return None
        return CompletionResponse(text=self.content, delta=event.content, additional_kwargs=extra,
                                  logprobs=self.logprobs)

    def _feed(self, event: StreamEvent) -> bool:
        """Accumulate the event's text and call pieces; False when it carries neither."""
        self.content += event.content
        self.reasoning += event.reasoning
        for delta in event.tool_call_deltas:
            call = self.calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id or ""
            call["name"] = call["name"] or delta.name or ""
            call["arguments"] += delta.arguments
        return bool(event.content or event.reasoning or event.tool_call_deltas)

    def _add_logprobs(self, event: StreamEvent) -> bool:
        """Accumulate the event's tokens' logprobs (a token whose text is held back, or is
        call markup, brings its logprob all the same); False when it brings none."""
        tokens = llama_logprobs(self.convert(event.logprobs)) if self.convert else None
        if tokens is None:
            return False
        # A new list, not an append: the chunks handed out already keep theirs.
        self.logprobs = [*(self.logprobs or ()), *tokens]
        return bool(tokens)


def delta_dict(delta: ToolCallDelta) -> dict[str, Any]:
    """A tool-call delta in OpenAI's streaming shape (id and name on a call's first)."""
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        function["name"] = delta.name
    out: dict[str, Any] = {"index": delta.index, "function": function}
    if delta.id is not None:
        out.update(id=delta.id, type="function")
    return out


def completion_response(completion: Completion, model_name: str, delta: str | None = None,
                        extra: Mapping[str, Any] | None = None,
                        logprobs: TokenLogProbs | None = None) -> CompletionResponse:
    """A whole (or the last streamed) completion; reasoning goes to additional_kwargs."""
    additional = dict(extra or {})
    if completion.reasoning:
        additional["reasoning"] = completion.reasoning
    return CompletionResponse(text=completion.content, delta=delta,
                              raw=final_raw(completion, model_name), additional_kwargs=additional,
                              logprobs=logprobs)


def json_kwargs(output_cls: type[BaseModel],
                llm_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Chat options that force the output to JSON valid against ``output_cls``'s schema."""
    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise TypeError(f"output_cls must be a pydantic BaseModel subclass, got "
                        f"{output_cls!r:.60}")
    if llm_kwargs is not None and not isinstance(llm_kwargs, Mapping):
        raise TypeError(f"llm_kwargs must be a dict of chat options, got "
                        f"{type(llm_kwargs).__name__}")
    return {**(llm_kwargs or {}), "constraint": JsonSchema(output_cls.model_json_schema())}


def _cut_structured(output_cls: type[Any], response: ChatResponse) -> None:
    """Raise ``OutputTruncatedError`` when the engine says max_tokens cut the response's
    JSON (``raw["truncated"]``, from ``Completion.truncated``)."""
    raw = response.raw if isinstance(response.raw, Mapping) else {}
    if not raw.get("truncated"):
        return
    usage = raw.get("usage")
    tokens = int((usage if isinstance(usage, Mapping) else {}).get("completion_tokens") or 0)
    raise OutputTruncatedError(
        tokens, tokens, f"the JSON for {getattr(output_cls, '__name__', 'the output')}")


def parse_structured(output_cls: type[Any], response: ChatResponse) -> Any:
    """``output_cls`` from a constrained response; ``OutputTruncatedError`` (naming
    max_tokens) when max_tokens cut the JSON, instead of a field-level error."""
    _cut_structured(output_cls, response)
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(f"the model's JSON for {output_cls.__name__} did not validate: "
                         f"{text[:200]!r}") from exc


def check_structured_chunk(output_cls: type[Any], response: ChatResponse) -> None:
    """A streamed structured response: its last chunk raises if max_tokens cut the JSON
    (earlier chunks carry no finish reason and pass as partial objects)."""
    _cut_structured(output_cls, response)
