"""``POST /v1/responses`` requests: validation, input items -> chat messages.

Input is a string or a list of items: messages (``role`` + text or text parts),
``function_call``, ``function_call_output`` and ``reasoning``. A reasoning item (its
``content`` of ``reasoning_text`` parts, else its ``summary``) is the past reasoning of the
assistant turn that follows it: that turn's ``reasoning_content``, which templates that
render past thinking (Qwen3's) show and others ignore; one followed by no assistant turn
is dropped. Items are kept as plain dicts in the store, so a continuation
(``previous_response_id``) replays exactly what was said, reasoning included.

``reasoning.effort`` reaches the chat template as ``reasoning_effort``, as chat
completions' ``reasoning_effort`` does; ``reasoning_budget`` (this server's, as on chat
completions) caps the reasoning tokens when the template opens the block.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from engine import (
    Constraint,
    InvalidRequestError,
    Message,
    messages_from_openai,
)
from mlx_providers.server.chat_request import OpenModel, ReasoningEffort
from mlx_providers.server.errors import APIError
from mlx_providers.server.keep_alive import KeepAliveField
from mlx_providers.server.tool_options import output_constraint, tool_choice_name


class InputText(OpenModel):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""


class InputImage(OpenModel):
    """An image part: ``image_url`` a data: URI (remote URLs and file ids are refused by
    the engine, which fetches nothing)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


InputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]


class ReasoningText(OpenModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(OpenModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(OpenModel):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None


class ReasoningOptions(OpenModel):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _item_kind(value: Any) -> str:
    """Which item class validates an input item (by its ``type``; messages may omit it)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", "message")
    # A type that is not a string (a list, an object) is no known kind: a 400, not a 500.
    return _KINDS.get(kind, "unknown") if isinstance(kind, str) else "unknown"


_KINDS = {"message": "MessageItem", "function_call": "FunctionCallItem",
          "function_call_output": "FunctionCallOutputItem", "reasoning": "ReasoningItem"}
# One member per item type, so a bad item gets that type's errors only.
InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_kind)]


class FunctionTool(OpenModel):
    type: Literal["function"]
    name: str  # which names a call can be written with is the engine's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(OpenModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenModel):
    """The parameters this server honours; the rest are accepted and ignored."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    # This server's: the sampling options chat completions take (no logprobs: Responses
    # output carries none yet).
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    reasoning: ReasoningOptions | None = None
    # This server's, as on chat completions: at most this many reasoning tokens when the
    # template opens the block.
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None
    # This server's, as on chat completions: tools beside text.format refuse a call that
    # repeats an answered one unless this is true; a tool called and answered
    # ``tool_call_limit`` times is no longer offered to a grammar-decided reply.
    repeat_answered_calls: bool = False
    tool_call_limit: Annotated[int, Field(ge=1)] | None = None
    # This server's, as on chat completions: a LoRA adapter for this request.
    adapter: str | None = None
    # This server's, as on chat completions: how long the model stays loaded once idle.
    keep_alive: KeepAliveField = None

    def input_items(self) -> list[dict[str, Any]]:
        """The new input as plain item dicts (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def engine_tools(self) -> list[dict[str, Any]] | None:
        """Tools in the flat shape Responses uses (the engine reads it as OpenAI's inner
        function dict), so its refusals name ``tools[i].parameters`` as the client wrote."""
        if not self.tools:
            return None
        return [{"name": t.name, "description": t.description or "",
                 "parameters": t.parameters or {"type": "object", "properties": {}}}
                for t in self.tools]

    def engine_tool_choice(self) -> str | None:
        return tool_choice_name(self.tool_choice)

    def template_kwargs(self) -> dict[str, Any]:
        """Chat-template variables: the reasoning effort, when one was asked."""
        effort = self.reasoning.effort if self.reasoning else None
        return {"reasoning_effort": effort} if effort is not None else {}

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text else None
        return output_constraint(fmt.type if fmt else None, fmt.schema_ if fmt else None,
                                 "text.format.schema")


def messages_of(items: list[dict[str, Any]], instructions: str | None) -> tuple[Message, ...]:
    """Chat messages for a history of items, converted once by the engine's rulebook;
    consecutive calls join one assistant turn. A refusal is a 400 naming the item field."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []  # the request field each message (or call) came from
    calls: dict[int, list[str]] = {}
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    names: dict[str, str] = {}
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                reasoning.append(text)
            continue
        if kind == "message":
            messages.append({"role": item["role"], "content": _content(item["content"])})
            origins.append(f"input[{i}]")
        elif kind == "function_call" and item.get("status") == "incomplete":
            continue  # a call cut by its response's end (sent as written), never run
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                origins.append(f"input[{i}]")
            calls.setdefault(len(messages) - 1, []).append(f"input[{i}]")
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "name": names.get(item["call_id"], ""),
                             "content": _content(item["output"])})
            origins.append(f"input[{i}]")
        else:
            continue
        turn = messages[-1]
        if reasoning and turn["role"] == "assistant":  # after any thinking it already had
            past = turn.get("reasoning_content")
            turn["reasoning_content"] = "\n\n".join([past, *reasoning] if past else reasoning)
        reasoning = []  # taken by this assistant turn, or no assistant's thinking at all
    try:
        return messages_from_openai(messages)
    except InvalidRequestError as exc:
        param = _item_field(exc.field, origins, calls)
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc


_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)")
# Chat-message field names as the Responses items spell them.
_ITEM_NAMES = {".tool_call_id": ".call_id"}


def _item_field(field: str, origins: list[str], calls: dict[int, list[str]]) -> str:
    """The Responses request field behind a chat-message field the rulebook named."""
    found = _MESSAGE_FIELD.fullmatch(field)
    if found is None:
        return "input"
    index, call, rest = int(found.group(1)), found.group(2), found.group(3)
    if call is not None:
        return calls[index][int(call)] + rest
    return origins[index] + _ITEM_NAMES.get(rest, rest)


def _reasoning_text(item: dict[str, Any]) -> str:
    """The reasoning an item carries: its content's text, else its summaries'."""
    content = item.get("content")
    if content:
        return "".join(str(part.get("text", "")) for part in content)
    return "\n\n".join(str(part.get("text", "")) for part in item.get("summary") or ())


def _content(content: Any) -> str | list[Any]:
    """An item's content for the rulebook: its text (a string, or the text of its parts:
    input_text, output_text, ...), or, where it holds images, its parts in order with each
    image as an ``input_image`` part."""
    if isinstance(content, str):
        return content
    parts = [part for part in content or () if isinstance(part, dict)]
    if not any(part.get("type") == "input_image" for part in parts):
        return "".join(str(part.get("text", "")) for part in parts
                       if part.get("type") != "refusal")
    if any(part.get("type") == "input_image" and part.get("image_url") is None
           for part in parts):  # by file id: this server keeps no files
        raise APIError(400, "input_image: send the image as image_url (a data: URI); "
                       "file_id is not supported", param="input", code="invalid_value")
    return [part if part.get("type") == "input_image" else str(part.get("text", ""))
            for part in parts if part.get("type") != "refusal"]
