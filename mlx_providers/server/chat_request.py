"""``POST /v1/chat/completions`` requests: validation, then what the engine is asked.

Pydantic models check the request's shape and types (their errors become 400s naming the
parameter, see ``errors.from_validation``); messages, tools, tool choice and sampling
values are read by the engine's one rulebook (``engine.messages_from_openai``,
``body_sampling``), whose refusals name the field as every other door does.
Unknown OpenAI parameters are accepted and ignored, as OpenAI-compatible servers do, so
newer clients keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import (
    ChatRequest,
    Constraint,
    Message,
    messages_from_openai,
)
from mlx_providers.server.keep_alive import KeepAliveField
from mlx_providers.server.request_options import body_sampling
from mlx_providers.server.tool_options import engine_tools, output_constraint, tool_choice_name

# The efforts both endpoints take (a template that reads one, gpt-oss's, gets it as is).
ReasoningEffort = Literal["minimal", "low", "medium", "high"]


class OpenModel(BaseModel):
    """Extra keys are allowed: OpenAI adds fields often and clients send them."""

    model_config = ConfigDict(extra="allow")


class AgentOptions(OpenModel):
    """This server's request options every OpenAI-shaped door takes beside OpenAI's own
    (chat completions, Responses, legacy completions): each reaches ``SamplingParams``."""

    # At most this many reasoning tokens when the template opens the block.
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None
    # Tools beside a response format refuse a call that repeats an answered one (same tool
    # and arguments, a tool message for it); true admits it.
    repeat_answered_calls: bool = False
    # Calls to each tool the conversation may hold answered before the tool is no longer
    # offered to a grammar-decided reply (beside a response format, or required).
    tool_call_limit: Annotated[int, Field(ge=1)] | None = None
    # A LoRA adapter for this request (a registered name or a local directory in mlx-lm's
    # format), batched beside other adapters on the one base.
    adapter: str | None = None
    # As Ollama's: seconds (or "5m") the model stays loaded once idle after this request;
    # 0 unloads it right after, negative keeps it (mlx_providers.server.keep_alive).
    keep_alive: KeepAliveField = None


class FunctionDef(OpenModel):
    name: str  # which names a call can be written with is the engine's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenModel):
    name: str


class NamedToolChoice(OpenModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        return self


class StreamOptions(OpenModel):
    include_usage: bool = False


class ChatCompletionRequest(AgentOptions):
    """The parameters this server honours; the rest are accepted and ignored."""

    model: str
    # Dicts: the engine's rulebook reads them (roles, content parts, calls, results).
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    # This server's, as vLLM's: sampling options OpenAI's API does not have.
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's effort reaches templates that read it (gpt-oss's); the budget is this
    # server's: at most this many reasoning tokens when the template opens the block.
    reasoning_effort: ReasoningEffort | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def constraint_of(fmt: ResponseFormat | None) -> Constraint | None:
    """The engine constraint for ``response_format`` (a bad schema is a 400 naming it)."""
    return output_constraint(
        fmt.type if fmt else None, fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
        "response_format.json_schema.schema")


def chat_messages(messages: list[dict[str, Any]]) -> tuple[Message, ...]:
    """The request's messages, converted once by the engine's rulebook.

    A null field is one the client did not set (OpenAI's SDKs send ``"name": null``). An
    assistant turn's past reasoning, as ``reasoning_content`` or ``reasoning`` (the two
    keys this server answers with), reaches the template as ``reasoning_content``: the
    rulebook reads both.
    """
    return messages_from_openai([_set_fields(m) for m in messages])


def _set_fields(message: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None or k == "content"}


def engine_request(request: ChatCompletionRequest, *, default_max_tokens: int,
                   default_temperature: float) -> ChatRequest:
    """The engine request for a validated chat-completions request (the engine's rulebook
    refuses what it must: ``InvalidRequestError`` naming the field)."""
    constraint = constraint_of(request.response_format)
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    temperature = (request.temperature if request.temperature is not None
                   else default_temperature)
    params = body_sampling(request, max_tokens=max_tokens, temperature=temperature,
                           constraint=constraint)
    template = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        template.setdefault("reasoning_effort", request.reasoning_effort)
    tools = engine_tools([t.function for t in request.tools or ()])
    return ChatRequest.from_openai(chat_messages(request.messages), params, tools=tools,
                                   tool_choice=tool_choice_name(request.tool_choice),
                                   parallel_tool_calls=request.parallel_tool_calls,
                                   chat_template_kwargs=template)
