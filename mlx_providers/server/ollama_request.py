"""Ollama's request bodies (``/api/chat``, ``/api/generate``), read into what the engine is
asked: model names, messages, options, ``format`` and ``think``.

Pydantic checks shapes and types (a refusal names the field, ``options.top_p``); the
messages are rewritten into OpenAI's shape and read by the engine's one rulebook
(``ChatRequest.from_openai``), so Ollama's door accepts what every other door accepts:

- ``images`` (base64 strings) become image parts placed before the message's text, where
  Ollama puts them; ``thinking`` on an assistant turn is its past reasoning;
- an assistant's ``tool_calls`` get ids where they have none (Ollama's do not), and a
  ``tool`` message is matched to its call: by ``tool_call_id`` (LangChain's), else by
  ``tool_name`` (Ollama's), else the turn's first unanswered call;
- ``options`` are Ollama's names for the engine's ``REQUEST_OPTIONS`` (``num_predict``,
  ``repeat_penalty``; the rest share their names), read by the one conversion
  (``request_options.body_sampling``); this server's own options (``reasoning_budget``,
  ``tool_call_limit``, ``repeat_answered_calls``) are accepted there too, and Ollama's that
  the engine has no counterpart for (``num_ctx``, ``mirostat``...) are accepted and ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine import Constraint, SamplingParams
from mlx_providers.server.chat_request import FunctionDef
from mlx_providers.server.context import ServerContext, route_model
from mlx_providers.server.keep_alive import KeepAliveField
from mlx_providers.server.request_options import body_sampling
from mlx_providers.server.served import ServedModel
from mlx_providers.server.tool_options import engine_tools, output_constraint

LATEST = "latest"  # the tag Ollama gives a name that has none
# ``think``: on or off, or (gpt-oss's) an effort, which also turns it on.
Think = bool | Literal["low", "medium", "high"] | None
Format = Literal["", "json"] | dict[str, Any] | None


class OllamaModel(BaseModel):
    """Unknown keys are accepted and ignored: Ollama adds fields often."""

    model_config = ConfigDict(extra="allow", populate_by_name=False)


class OllamaOptions(OllamaModel):
    """``options``, under the engine's ``REQUEST_OPTIONS`` names (Ollama's as aliases), so
    ``body_sampling`` reads them as it reads the other doors' bodies."""

    max_tokens: int | None = Field(None, alias="num_predict")  # <= 0 (-1: "forever"): unset
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(
        None, alias="repeat_penalty")
    repeat_last_n: int | None = None  # > 0: the penalty's window; 0 or -1: the default's
    seed: int | None = None  # negative (Ollama's -1): a random seed, as none
    stop: str | list[str] | None = None
    num_ctx: int | None = None  # accepted: the context is the model's, and longer is refused
    # This server's options, which Ollama's API has no name for.
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None
    repeat_answered_calls: bool | None = None
    tool_call_limit: Annotated[int, Field(ge=1)] | None = None

    @field_validator("max_tokens", "seed")
    @classmethod
    def _negative_is_unset(cls, value: int | None) -> int | None:
        # Ollama's -1 (and num_predict's -2, 0) mean "no limit" / "random": the defaults.
        return None if value is None or value <= 0 else value

    @field_validator("repetition_penalty")
    @classmethod
    def _one_is_off(cls, value: float | None) -> float | None:
        return None if value == 1 else value  # a penalty of 1 changes nothing


class OllamaMessage(OllamaModel):
    """One of ``messages``: Ollama's fields, rewritten for the rulebook by
    ``openai_messages``."""

    role: str  # the rulebook checks it (system, user, assistant, tool)
    content: str | None = None
    images: list[str] | None = None  # base64, or data: URIs
    thinking: str | None = None
    tool_calls: list[Any] | None = None  # the rulebook reads each call
    tool_name: str | None = None  # Ollama's: the tool a result is of
    tool_call_id: str | None = None  # LangChain's ChatOllama sends the call's id


class OllamaTool(OllamaModel):
    """A function tool, as chat completions take it (Ollama's are OpenAI's shape)."""

    type: Literal["function"] = "function"
    function: FunctionDef


class GenerationFields(OllamaModel):
    """What both generating endpoints take besides their prompt."""

    model: Annotated[str, Field(min_length=1)]
    format: Format = None
    options: OllamaOptions = Field(default_factory=lambda: OllamaOptions.model_validate({}))
    stream: bool = True  # Ollama streams unless told not to
    think: Think = None
    keep_alive: KeepAliveField = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("options", "stream", "logprobs", mode="before")
    @classmethod
    def _null_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        # A client that sends an unset field as null gets its default (Ollama's too).
        if value is not None:
            return value
        return {"options": {}, "stream": True, "logprobs": False}[info.field_name or ""]


class OllamaChatRequest(GenerationFields):
    """``/api/chat``'s body."""

    # Empty: a request that only loads the model (or unloads it: keep_alive 0).
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None


class OllamaGenerateRequest(GenerationFields):
    """``/api/generate``'s body."""

    prompt: str | None = None  # empty (and no suffix): load (or unload) the model
    suffix: str | None = None  # fill-in-the-middle, for a tokenizer with FIM tokens
    system: str | None = None
    template: str | None = None  # Go templates: refused unless empty (see ollama_generate)
    context: list[int] | None = None  # the deprecated token context: accepted, ignored
    raw: bool = False
    images: list[str] | None = None


def served_model(ctx: ServerContext, name: str) -> tuple[ServedModel, str | None]:
    """The served model (and adapter) ``name`` names: a served name, ``name:latest``
    (Ollama tags every name), or ``base:adapter`` for a registered adapter."""
    return route_model(ctx, untagged(name, ctx.models.serves, ctx.settings.adapters), None)


def untagged(name: str, serves: Callable[[str], bool], adapters: Collection[str] = ()) -> str:
    """``name`` without a ``:latest`` tag, unless the tagged name is served itself (or
    ``latest`` is a registered adapter's name)."""
    base, sep, tag = name.rpartition(":")
    if sep and tag == LATEST and base and not serves(name) and LATEST not in adapters:
        return base
    return name


def tagged(name: str) -> str:
    """The name Ollama lists a model under: with its tag, ``:latest`` when it has none."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{LATEST}"


def format_constraint(fmt: Format) -> Constraint | None:
    """``format``: "json" (any JSON object) or a JSON schema; "" or absent: free text."""
    if not fmt:
        return None
    if fmt == "json":
        return output_constraint("json_object", None, "format")
    assert isinstance(fmt, dict)
    return output_constraint("json_schema", fmt, "format")


def think_template(think: Think) -> dict[str, Any]:
    """``think`` as template variables: ``enable_thinking`` (Qwen3's and most thinking
    templates'), and an effort as ``reasoning_effort`` too (gpt-oss's)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    return {"enable_thinking": True, "reasoning_effort": think}


def sampling(body: GenerationFields, *, default_max_tokens: int, default_temperature: float,
             constraint: Constraint | None, adapter: str | None) -> SamplingParams:
    """The request's ``SamplingParams``: its options, the server's defaults for what it
    left unset (no ``num_predict``: ``--max-tokens``; no temperature: ``--temperature``),
    and logprobs (``top_logprobs`` alone asks for them too)."""
    options = body.options
    given: dict[str, Any] = {
        "max_tokens": options.max_tokens or default_max_tokens,
        "temperature": (options.temperature if options.temperature is not None
                        else default_temperature),
        "constraint": constraint, "adapter": adapter,
        "logprobs": body.logprobs or bool(body.top_logprobs),
        "top_logprobs": body.top_logprobs}
    if options.repeat_last_n is not None and options.repeat_last_n > 0:
        given["repetition_context_size"] = options.repeat_last_n
    return body_sampling(options, **given)


def chat_tools(tools: Sequence[OllamaTool] | None) -> list[dict[str, Any]] | None:
    """The engine's tools (an empty list, which the ``ollama`` client sends, is none)."""
    return engine_tools([t.function for t in tools or ()])


@dataclass
class MessageFields:
    """How many images went before each message's text, so a refusal the rulebook names
    as a content part (``messages[1].content[0]``) names what the client sent
    (``messages[1].images[0]``)."""

    images: dict[int, int] = field(default_factory=dict)

    def ollama_field(self, name: str) -> str:
        found = _CONTENT_PART.fullmatch(name)
        if found is None:
            return name
        index, part, rest = int(found.group(1)), int(found.group(2)), found.group(3)
        count = self.images.get(index, 0)
        if part < count:
            return f"messages[{index}].images[{part}]{rest}"
        return f"messages[{index}].content"


_CONTENT_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\](.*)")


def openai_messages(messages: Sequence[OllamaMessage],
                    fields: MessageFields | None = None) -> list[dict[str, Any]]:
    """Ollama's messages in OpenAI's shape, for the rulebook (see the module's notes);
    ``fields`` records where each image went, for the rulebook's refusals."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the latest calls not yet answered
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role,
                                "content": image_content(message.content or "", message.images)}
        if message.images and fields is not None:
            fields.images[i] = len(message.images)
        if message.role == "assistant":
            if message.thinking:
                item["reasoning_content"] = message.thinking
            if message.tool_calls:
                item["tool_calls"] = [_with_id(call, i, j)
                                      for j, call in enumerate(message.tool_calls)]
                unanswered = [(c["id"], _call_name(c)) for c in item["tool_calls"]
                              if isinstance(c, dict)]
        elif message.role == "tool":
            item["tool_call_id"] = _answered(message, unanswered, i)
            if message.tool_name:
                item["name"] = message.tool_name
        out.append(item)
    return out


def image_content(text: str, images: Sequence[str] | None) -> str | list[dict[str, Any]]:
    """A message's content: its text, after its images (where Ollama puts them)."""
    if not images:
        return text
    # LangChain's standard image block: base64 (or a data: URI) read by the rulebook.
    parts: list[dict[str, Any]] = [{"type": "image", "base64": image} for image in images]
    return [*parts, {"type": "text", "text": text}]


def _with_id(call: Any, message: int, index: int) -> Any:
    """A call with an id (Ollama's have none): stable for the same history, so a replayed
    conversation renders the same prompt (and hits the prefix cache)."""
    if not isinstance(call, dict):
        return call  # the rulebook refuses it, naming the field
    function = call.get("function")
    if isinstance(function, dict):  # Ollama's ``function.index`` is no template's
        function = {k: v for k, v in function.items() if k != "index"}
    return {**call, "function": function, "id": call.get("id") or f"call_{message}_{index}"}


def _call_name(call: dict[str, Any]) -> str:
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""


def _answered(message: OllamaMessage, unanswered: list[tuple[str, str]], index: int) -> str:
    """The id of the call a tool message answers (removed from ``unanswered``)."""
    match = next((c for c in unanswered if message.tool_call_id and c[0] ==
                  message.tool_call_id), None)
    if match is None and message.tool_name:
        match = next((c for c in unanswered if c[1] == message.tool_name), None)
    if match is None and unanswered and not message.tool_call_id:
        match = unanswered[0]
    if match is None:  # a result of no call the history shows: it keeps its own id
        return message.tool_call_id or f"call_result_{index}"
    unanswered.remove(match)
    return match[0]
