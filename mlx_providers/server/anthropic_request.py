"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` requests: validation, then what
the engine is asked.

Pydantic models check the shapes of the ``anthropic`` SDK's ``MessageCreateParams`` (their
errors become 400s naming the field); messages go through ``anthropic_messages`` to the
engine's one rulebook, tools and the tool choice through ``ChatRequest.from_openai``, and
every sampling option through ``body_sampling`` (each of ``engine.REQUEST_OPTIONS`` this
body has: Anthropic's ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and
``stop_sequences``, and this server's ``min_p``, ``repetition_penalty``, ``seed``,
``logprobs``, ``reasoning_budget``, ... sent as ``extra_body`` from the SDKs). Fields this
server has no use for (``metadata``, ``service_tier``, ``cache_control``, ``container``)
are accepted and ignored, so newer clients keep working.

How Anthropic's options map:

- ``tool_choice``: ``auto`` / ``any`` (a call is required) / ``tool`` (that one) / ``none``
  (the tools are not shown), enforced by the engine's grammar;
  ``disable_parallel_tool_use`` -> one call at most (``parallel_tool_calls`` false);
- ``thinking``: ``enabled`` turns the template's thinking on (``enable_thinking``) and its
  ``budget_tokens`` is the engine's reasoning budget; ``adaptive`` turns it on unbounded;
  ``disabled`` turns it off;
- ``output_config.format`` (``json_schema``) is the answer's JSON-schema constraint;
  ``output_config.effort`` reaches the template as ``reasoning_effort`` (gpt-oss's reads it;
  ``xhigh`` and ``max`` as ``high``, the most a template knows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import (
    ChatRequest,
    Constraint,
    InvalidRequestError,
    Message,
    SamplingParams,
    messages_from_openai,
)
from mlx_providers.server.anthropic_messages import MessageFields, chat_messages
from mlx_providers.server.errors import APIError, field_renamed
from mlx_providers.server.keep_alive import KeepAliveField
from mlx_providers.server.request_options import body_sampling
from mlx_providers.server.tool_options import output_constraint


class AnthropicModel(BaseModel):
    """Extra keys are allowed: Anthropic adds fields often and clients send them."""

    model_config = ConfigDict(extra="allow")


class MessageParam(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    # Blocks stay dicts: ``anthropic_messages`` reads them (and the rulebook refuses what
    # it does not read, naming the block).
    content: str | list[dict[str, Any]]


class TextBlockParam(AnthropicModel):
    type: Literal["text"]
    text: str


class ToolParam(AnthropicModel):
    """A client tool. Server tools (``web_search_…``, ``bash_…``) are not run here."""

    name: str  # which names a call can be written with is the engine's rule
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind not in (None, "custom"):
            raise ValueError(f"{kind!r:.60} is a server tool, which this server does not "
                             "run: give client tools (name, description, input_schema)")
        return value


class ToolChoiceParam(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' names its tool: "
                             "{'type': 'tool', 'name': ...}")
        return self


class ThinkingParam(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic's models want >= 1024; any budget is this engine's to keep (a small model
    # may be given a few tokens).
    budget_tokens: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return self


class JsonOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


# Anthropic's efforts as a template's ``reasoning_effort`` (the levels templates read).
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class ConversationRequest(AnthropicModel):
    """What both endpoints read: the conversation, tools and what shapes the prompt."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    # This server's, as on chat completions: a registered LoRA adapter for this request.
    adapter: str | None = None

    def system_blocks(self) -> str | list[dict[str, Any]] | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return [block.model_dump() for block in self.system]

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def engine_tools(self) -> list[dict[str, Any]] | None:
        """Tools in the flat function shape (the engine reads it as OpenAI's inner
        function dict), so a refusal names ``tools[i]``'s own field."""
        if not self.tools:
            return None
        return [{"name": t.name, "description": t.description or "",
                 "parameters": t.input_schema} for t in self.tools]

    def engine_tool_choice(self) -> tuple[str | None, bool]:
        """The engine's tool choice and whether several calls may be made at once."""
        choice = self.tool_choice
        if choice is None:
            return None, True
        if choice.type in ("any", "tool") and not self.tools:
            raise APIError(400, f"tool_choice: a tool_choice of type {choice.type!r} needs "
                           "tools", param="tool_choice", code="invalid_value")
        name = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type,
                                                                       choice.name)
        return name, not choice.disable_parallel_tool_use

    def template_kwargs(self) -> dict[str, Any]:
        """Chat-template variables: thinking on or off, and the effort when one is set."""
        out: dict[str, Any] = {}
        if self.thinking is not None:
            out["enable_thinking"] = self.thinking.type != "disabled"
        effort = self.output_config.effort if self.output_config else None
        if effort is not None:
            out["reasoning_effort"] = EFFORTS[effort]
        return out

    def constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config else None
        return output_constraint(fmt.type if fmt else None, fmt.schema_ if fmt else None,
                                 "output_config.format.schema")


class MessagesRequest(ConversationRequest):
    """``POST /v1/messages``: the parameters this server honours; the rest are ignored."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # Anthropic's user id: nothing to do with it
    # This server's, as on chat completions (extra_body from the SDKs).
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None
    repeat_answered_calls: bool = False
    tool_call_limit: Annotated[int, Field(ge=1)] | None = None
    keep_alive: KeepAliveField = None

    def budget(self) -> int | None:
        """The reasoning budget: ``thinking.budget_tokens``, or this server's
        ``reasoning_budget`` (both must agree)."""
        thinking = self.thinking.budget_tokens if self.thinking else None
        if thinking is not None and self.reasoning_budget is not None and (
                thinking != self.reasoning_budget):
            raise APIError(400, f"thinking.budget_tokens ({thinking}) and reasoning_budget "
                           f"({self.reasoning_budget}) disagree: give one",
                           param="thinking.budget_tokens", code="invalid_value")
        return thinking if thinking is not None else self.reasoning_budget

    def sampling(self, default_temperature: float) -> SamplingParams:
        """Every request option of the body as the engine's ``SamplingParams``."""
        temperature = (self.temperature if self.temperature is not None
                       else default_temperature)
        return body_sampling(self, temperature=temperature, stop=self.stop_sequences,
                             reasoning_budget=self.budget(), constraint=self.constraint())


class CountTokensRequest(ConversationRequest):
    """``POST /v1/messages/count_tokens``: the conversation, no sampling."""


@dataclass(frozen=True)
class Converted:
    """A request as the engine reads it, and where its messages came from (refusals)."""

    spec: ChatRequest
    fields: MessageFields


def engine_request(req: ConversationRequest, params: SamplingParams) -> Converted:
    """The engine request for a validated request; a refusal raises naming the client's
    field (an ``APIError``, or the engine's ``ValueError`` for ``from_engine``)."""
    messages, fields = chat_messages(req.system_blocks(), req.message_dicts())
    typed = rulebook_messages(messages, fields)
    tool_choice, parallel = req.engine_tool_choice()
    try:
        spec = ChatRequest.from_openai(typed, params, tools=req.engine_tools(),
                                       tool_choice=tool_choice, parallel_tool_calls=parallel,
                                       chat_template_kwargs=req.template_kwargs())
    except InvalidRequestError as exc:
        raise _renamed(exc, fields) from exc
    return Converted(spec, fields)


def rulebook_messages(messages: list[dict[str, Any]],
                      fields: MessageFields) -> tuple[Message, ...]:
    """The chat messages through the engine's rulebook, refusals naming Anthropic fields."""
    try:
        return messages_from_openai(messages)
    except InvalidRequestError as exc:
        raise _renamed(exc, fields) from exc


def _renamed(exc: InvalidRequestError, fields: MessageFields) -> APIError:
    param = fields.anthropic_field(exc.field)
    return APIError(400, field_renamed(str(exc), exc.field, param), param=param,
                    code="invalid_value")
