"""``POST /v1/chat/completions`` requests: validation, then what the engine is asked.

Pydantic models check shapes and types (their errors become 400s naming the parameter,
see ``errors.from_validation``); unknown OpenAI parameters are accepted and ignored, as
OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import Constraint, SamplingParams
from mlx_providers._chat import normalize_messages
from mlx_providers.server.errors import APIError
from mlx_providers.server.generation import GenerationSpec
from mlx_providers.server.tool_options import engine_tools, output_constraint, tool_choice_name


class OpenModel(BaseModel):
    """Extra keys are allowed: OpenAI adds fields often and clients send them."""

    model_config = ConfigDict(extra="allow")


class TextPart(OpenModel):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCallIn(OpenModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(OpenModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(OpenModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
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


class ChatCompletionRequest(OpenModel):
    """The parameters this server honours; the rest are accepted and ignored."""

    model: str
    messages: Annotated[list[MessageIn], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def constraint_of(fmt: ResponseFormat | None) -> Constraint | None:
    """The engine constraint for ``response_format`` (a bad schema is a 400 naming it)."""
    return output_constraint(
        fmt.type if fmt else None, fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
        "response_format.json_schema.schema")


def chat_messages(messages: list[MessageIn]) -> list[dict[str, Any]]:
    """Messages as plain dicts the chat template accepts (roles, tool calls, tool results)."""
    plain: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True, include={
            "role", "content", "name", "tool_calls", "tool_call_id"})
        if message.tool_calls:
            for j, call in enumerate(message.tool_calls):
                args = call.function.arguments
                if isinstance(args, str) and args.strip():
                    try:
                        json.loads(args)
                    except ValueError as exc:
                        raise APIError(400, f"arguments are not JSON: {exc}", param=(
                            f"messages[{i}].tool_calls[{j}].function.arguments"),
                            code="invalid_value") from exc
        plain.append(item)
    return normalize_messages(plain)


def sampling(temperature: float | None, top_p: float | None, max_tokens: int,
             seed: int | None = None, stop: str | list[str] | None = None,
             logprobs: bool = False, top_logprobs: int | None = None,
             constraint: Constraint | None = None) -> SamplingParams:
    """SamplingParams from OpenAI's names (``None`` temperature: the server's default)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0, seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=logprobs or bool(top_logprobs), top_logprobs=top_logprobs or 0,
        constraint=constraint)


def generation_spec(request: ChatCompletionRequest, *, default_max_tokens: int,
                    default_temperature: float) -> GenerationSpec:
    """The engine request for a validated chat-completions request."""
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                       code="invalid_value")
    constraint = constraint_of(request.response_format)
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    temperature = request.temperature if request.temperature is not None else default_temperature
    params = sampling(temperature, request.top_p, max_tokens, request.seed, request.stop,
                      request.logprobs, request.top_logprobs, constraint)
    tools = engine_tools([t.function for t in request.tools or ()])
    return GenerationSpec(chat_messages(request.messages), params, tools,
                          tool_choice_name(request.tool_choice),
                          request.parallel_tool_calls, request.chat_template_kwargs or {})
