"""``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``:
Anthropic's Messages API, a door built as chat completions and Responses are.

Validate (``anthropic_request``), convert once to the engine's ``ChatRequest`` (images on a
worker thread), then the shared generation flow (``generation.serve``: admission, submit,
the first event before any byte, the whole message or its SSE events, the one owner of the
request's cancel, so a client that disconnects evicts its row). Everything it raises is
answered in Anthropic's error envelope (``anthropic_errors``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import ChatRequest, Engine, EngineError, SamplingParams, StreamEvent
from mlx_providers.server.anthropic_errors import anthropic_errors
from mlx_providers.server.anthropic_events import MessageTranslator
from mlx_providers.server.anthropic_messages import MessageFields, has_images
from mlx_providers.server.anthropic_request import (
    ConversationRequest,
    CountTokensRequest,
    MessagesRequest,
    engine_request,
)
from mlx_providers.server.context import (
    ServerContext,
    off_loop,
    read_json,
    route_model,
    validate,
)
from mlx_providers.server.errors import from_engine
from mlx_providers.server.generation import Endpoint, serve

ENDPOINT = "messages"
# Where engine errors point for this endpoint's parameter names.
_PARAMS = {"prompt_param": "messages", "max_tokens_param": "max_tokens"}


class MessagesAnswer:
    """The Messages side of ``generation.serve``: events as SSE (each with its ``event:``
    line, which Anthropic's SDKs dispatch on), or the whole message."""

    def __init__(self, translator: MessageTranslator) -> None:
        self.translator = translator

    def start(self) -> list[dict[str, str]]:
        return [_sse(event) for event in self.translator.start()]

    def feed(self, event: StreamEvent) -> list[dict[str, str]]:
        return [_sse(item) for item in self.translator.feed(event)]

    def fail(self, error: BaseException) -> list[dict[str, str]]:
        return [_sse(event) for event in self.translator.fail(error)]

    def end(self) -> list[dict[str, str]]:
        return []

    def body(self) -> dict[str, Any]:
        return self.translator.message()

    def close(self, outcome: str) -> None:
        """Nothing to keep: messages are not stored."""


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"],
            "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


async def _converted(req: ConversationRequest, params: SamplingParams,
                     ) -> tuple[ChatRequest, MessageFields]:
    """The engine request (on a worker thread when images are decoded); a refusal is the
    server's error naming the client's field."""
    fields = MessageFields()

    def convert() -> ChatRequest:
        nonlocal fields  # kept for the refusals from_openai raises too
        converted = engine_request(req, params)
        fields = converted.fields
        return converted.spec

    try:
        return await off_loop(has_images(req.message_dicts()), convert), fields
    except ValueError as exc:  # the rulebook's and SamplingParams' refusals
        raise from_engine(exc, fields=fields.anthropic_field, **_PARAMS) from exc


@anthropic_errors
async def create_message(request: Request) -> Response:
    """``POST /v1/messages`` (``?beta=true`` and the ``anthropic-version`` and
    ``anthropic-beta`` headers are accepted: this server has one version of the API)."""
    ctx: ServerContext = request.app.state.ctx
    req = validate(MessagesRequest, await read_json(request, ctx.settings.max_body_bytes))
    served, adapter = route_model(ctx, req.model, req.adapter)
    req = req.model_copy(update={"adapter": adapter})
    try:
        params = req.sampling(ctx.settings.default_temperature)
    except ValueError as exc:  # SamplingParams' refusals (an empty stop sequence)
        raise from_engine(exc, fields=MessageFields().anthropic_field, **_PARAMS) from exc
    spec, fields = await _converted(req, params)
    # A grammar that does not compile is the format's when there is one, else a tool's.
    endpoint = Endpoint(ENDPOINT, ctx.metrics, {
        **_PARAMS, "constraint_param": "output_config.format" if params.constraint else "tools"},
        fields=fields.anthropic_field)
    engine = served.engine
    translator = MessageTranslator(
        served.name, stop_sequences=params.stop,
        decode=lambda ids: str(engine.tokenizer.decode(ids)),
        token_text=served.token_text if req.logprobs else None)
    answer = MessagesAnswer(translator)

    async def run() -> Response:
        # max_tokens is required here and clients send their model's ceiling (LangChain's
        # ChatAnthropic 4096 for a model it does not know): read as a ceiling, it is cut
        # to the room the context has left, as the other doors do with no limit set.
        return await serve(request, endpoint, served, spec, answer, stream=req.stream,
                           fit_context=True, keep_alive=req.keep_alive)

    if not req.stream:
        return await run()  # the final usage counts the prompt
    return await _counting(engine, spec, translator, run)


async def _counting(engine: Engine, spec: ChatRequest, translator: MessageTranslator,
                    run: Callable[[], Awaitable[Response]]) -> Response:
    """``run()``, with the prompt counted on a worker thread meanwhile for
    ``message_start``'s ``usage.input_tokens`` (the engine reports usage at the end): the
    count overlaps the row's admission and prefill instead of delaying them."""
    async def count() -> None:
        try:
            translator.input_tokens = await anyio.to_thread.run_sync(engine.count_tokens,
                                                                     spec)
        except Exception:  # any: a number for message_start only (the request's own
            pass  # refusal says what is wrong, and message_delta carries the usage)

    response: list[Response] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(count)
        try:
            response.append(await run())
        except Exception as exc:  # raised below, not wrapped in the group's ExceptionGroup
            failure.append(exc)
    if failure:
        raise failure[0]
    return response[0]


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as ``/v1/messages`` would
    render it (system, messages, tools, thinking), counted by the engine's tokenizer."""
    ctx: ServerContext = request.app.state.ctx
    req = validate(CountTokensRequest, await read_json(request, ctx.settings.max_body_bytes))
    served, _ = route_model(ctx, req.model, req.adapter)
    try:
        # The adapter changes no token of the prompt; a bad format schema is still a 400.
        params = SamplingParams(constraint=req.constraint())
    except ValueError as exc:
        raise from_engine(exc, fields=None, **_PARAMS) from exc
    spec, fields = await _converted(req, params)
    try:
        tokens = await anyio.to_thread.run_sync(served.engine.count_tokens, spec)
    except (ValueError, TypeError, EngineError) as exc:
        raise from_engine(exc, fields=fields.anthropic_field, **_PARAMS) from exc
    return JSONResponse({"input_tokens": tokens})
