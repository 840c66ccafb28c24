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
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from engine import (
    Constraint,
    InvalidRequestError,
    Message,
    messages_from_openai,
)
from mlx_providers.server.chat_request import AgentOptions, OpenModel, ReasoningEffort
from mlx_providers.server.errors import APIError, field_renamed
from mlx_providers.server.tool_options import output_constraint, tool_choice_name

# The ``include`` value that asks for output_text logprobs (OpenAI's ``ResponseIncludable``;
# the others name outputs this server does not produce, and are ignored).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


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


class ResponsesRequest(AgentOptions):
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
    # ``include: ["message.output_text.logprobs"]`` puts each output_text token's logprobs
    # on its part and its deltas, with ``top_logprobs`` alternatives (which ask for them too).
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # This server's: the sampling options chat completions take.
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

    @property
    def logprobs(self) -> bool:
        """Whether output_text carries logprobs: included, or alternatives asked for (an
        ask for alternatives alone is not dropped without a word)."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

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


@dataclass
class InputFields:
    """Where each chat message the rulebook reads came from in the Responses request, so
    its refusals (named as chat fields: ``messages[1].content[2]``) name what the client
    sent (``input[0].content[3]``)."""

    items: list[str] = field(default_factory=list)  # per message: its item ("input[3]")
    contents: list[str] = field(default_factory=list)  # per message: the item's content field
    # Per message: the item's index of each content part the rulebook sees (refusal parts
    # are not passed on), or None where the content went as text.
    parts: list[list[int] | None] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # message -> its calls' items

    def add(self, item: str, content: str, parts: list[int] | None = None) -> None:
        """The next chat message came from ``item``, its content from ``content``."""
        self.items.append(item)
        self.contents.append(content)
        self.parts.append(parts)

    def responses_field(self, name: str) -> str:
        """The Responses request field behind a field the rulebook named; a field that is
        no message's (``tools[0].name``) is the same in both."""
        if name == "messages":
            return "input"
        found = _MESSAGE_FIELD.fullmatch(name)
        if found is None:
            return name
        index, call, rest = int(found.group(1)), found.group(2), found.group(3)
        if index >= len(self.items):
            return "input"
        if call is not None:
            calls = self.calls.get(index, [])
            return _within(calls[int(call)], rest) if int(call) < len(calls) else (
                self.items[index])
        part = _CONTENT_FIELD.fullmatch(rest)
        if part is None:
            return _within(self.items[index], _ITEM_NAMES.get(rest, rest))
        where, number, tail = self.contents[index], part.group(1), part.group(2)
        if where in _WHOLE:
            return where
        if number is None:
            return where + tail
        kept = self.parts[index]
        k = int(number)
        return f"{where}[{kept[k] if kept is not None and k < len(kept) else k}]{tail}"


def input_messages(items: list[dict[str, Any]], instructions: str | None, *,
                   history: int = 0) -> tuple[tuple[Message, ...], InputFields]:
    """Chat messages for a history of items, converted once by the engine's rulebook, and
    where each came from; consecutive calls join one assistant turn. The first
    ``history`` items are a stored response's (``previous_response_id``), the rest are
    ``input``. A refusal is a 400 naming the item field."""
    messages: list[dict[str, Any]] = []
    fields = InputFields()
    if instructions:
        messages.append({"role": "system", "content": instructions})
        fields.add("instructions", "instructions")
    names: dict[str, str] = {}
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede
    for i, item in enumerate(items):
        at = "previous_response_id" if i < history else f"input[{i - history}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                reasoning.append(text)
            continue
        if kind == "message":
            where = _within(at, ".content")
            content, kept = _content(item["content"], where)
            messages.append({"role": item["role"], "content": content})
            fields.add(at, where, kept)
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
                fields.add(at, at)
            fields.calls.setdefault(len(messages) - 1, []).append(at)
        elif kind == "function_call_output":
            where = _within(at, ".output")
            content, kept = _content(item["output"], where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "name": names.get(item["call_id"], ""), "content": content})
            fields.add(at, where, kept)
        else:
            continue
        turn = messages[-1]
        if reasoning and turn["role"] == "assistant":  # after any thinking it already had
            past = turn.get("reasoning_content")
            turn["reasoning_content"] = "\n\n".join([past, *reasoning] if past else reasoning)
        reasoning = []  # taken by this assistant turn, or no assistant's thinking at all
    try:
        return messages_from_openai(messages), fields
    except InvalidRequestError as exc:
        param = fields.responses_field(exc.field)
        raise APIError(400, field_renamed(str(exc), exc.field, param), param=param,
                       code="invalid_value") from exc


def messages_of(items: list[dict[str, Any]], instructions: str | None) -> tuple[Message, ...]:
    """``input_messages``' chat messages alone."""
    return input_messages(items, instructions)[0]


_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)")
_CONTENT_FIELD = re.compile(r"\.content(?:\[(\d+)\])?(.*)")
# Chat-message field names as the Responses items spell them.
_ITEM_NAMES = {".tool_call_id": ".call_id"}
# Fields named whole: what the history of a stored response or the instructions hold is
# not the client's to point into.
_WHOLE = frozenset({"instructions", "previous_response_id"})


def _within(at: str, rest: str) -> str:
    """The field ``rest`` inside ``at`` (``at`` itself where it is named whole)."""
    return at if at in _WHOLE else at + rest


def _reasoning_text(item: dict[str, Any]) -> str:
    """The reasoning an item carries: its content's text, else its summaries'."""
    content = item.get("content")
    if content:
        return "".join(str(part.get("text", "")) for part in content)
    return "\n\n".join(str(part.get("text", "")) for part in item.get("summary") or ())


def _content(content: Any, at: str) -> tuple[str | list[Any], list[int] | None]:
    """An item's content for the rulebook, and the item's index of each part passed on:
    its text (a string, or the text of its parts: input_text, output_text, ...), or,
    where it holds images, its parts in order with each image as an ``input_image`` part.
    ``at`` is the content's field, for a refusal."""
    if isinstance(content, str):
        return content, None
    parts = list(enumerate(content or ()))
    if not any(isinstance(part, dict) and part.get("type") == "input_image"
               for _, part in parts):
        return "".join(str(part.get("text", "")) for _, part in parts
                       if isinstance(part, dict) and part.get("type") != "refusal"), None
    kept = [(k, part) for k, part in parts
            if isinstance(part, dict) and part.get("type") != "refusal"]
    for k, part in kept:
        if part.get("type") == "input_image" and part.get("image_url") is None:
            # By file id: this server keeps no files.
            param = at if at in _WHOLE else f"{at}[{k}]"
            raise APIError(400, f"{param}: send the image as image_url (a data: URI); "
                           "file_id is not supported", param=param, code="invalid_value")
    return ([part if part.get("type") == "input_image" else str(part.get("text", ""))
             for _, part in kept], [k for k, _ in kept])
