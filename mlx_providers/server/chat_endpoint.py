"""``POST /v1/chat/completions``: validate, admit, submit, answer (whole or as SSE)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import EngineError
from mlx_providers.server.chat_completions import ChatCompletionShaper
from mlx_providers.server.chat_request import ChatCompletionRequest, generation_spec
from mlx_providers.server.context import ServerContext, read_json, validate
from mlx_providers.server.errors import APIError, from_engine
from mlx_providers.server.generation import (
    ClientGone,
    EventStream,
    open_stream,
    unless_disconnected,
)
from mlx_providers.server.served import ServedModel, Slot

ENDPOINT = "chat_completions"
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by anyone


async def chat_completions(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await read_json(request, ctx.settings.max_body_bytes)
    chat = validate(ChatCompletionRequest, body)
    served = ctx.models.get(chat.model)
    try:
        spec = generation_spec(chat, default_max_tokens=ctx.settings.default_max_tokens,
                               default_temperature=ctx.settings.default_temperature)
    except ValueError as exc:  # SamplingParams' own checks (e.g. an empty stop string)
        raise from_engine(exc) from exc
    # A grammar that does not compile is the schema's when there is one, else a tool's.
    params = {"constraint_param": "response_format" if spec.params.constraint else "tools"}
    slot = served.admit()
    streaming = False
    try:
        try:
            stream = await open_stream(request, served.engine, spec, fit_context=(
                chat.max_tokens is None and chat.max_completion_tokens is None))
        except (ValueError, TypeError, EngineError) as exc:  # bad input, or a dead engine
            raise from_engine(exc, **params) from exc
        if stream.first.error is not None:
            raise from_engine(stream.first.error, **params)
        shaper = ChatCompletionShaper(served.name, served.token_text,
                                      include_usage=chat.include_usage,
                                      logprobs=chat.logprobs)
        if not chat.stream:
            return await _whole(ctx, request, served, stream, shaper, params)
        streaming = True  # from here on the stream releases the slot
        return EventSourceResponse(_chunks(ctx, served, stream, shaper, slot))
    except ClientGone:
        ctx.metrics.count(ENDPOINT, "disconnected")
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not streaming:
            slot.release()


async def _whole(ctx: ServerContext, request: Request, served: ServedModel,
                 stream: EventStream, shaper: ChatCompletionShaper,
                 params: dict[str, str]) -> Response:
    try:
        completion = await unless_disconnected(request, stream.handle, stream.completion)
    except (ClientGone, APIError):
        raise
    except Exception as exc:
        raise from_engine(exc, **params) from exc
    ctx.metrics.observe(served.name, completion.usage)
    ctx.metrics.count(ENDPOINT, "ok")
    return JSONResponse(shaper.completion(completion))


async def _chunks(ctx: ServerContext, served: ServedModel, stream: EventStream,
                  shaper: ChatCompletionShaper, slot: Slot) -> AsyncIterator[str]:
    """SSE data lines; a failure mid-stream sends OpenAI's error object, then ends."""
    outcome = "disconnected"  # unless the loop below reaches an end
    try:
        yield _data(shaper.first_chunk())
        async with contextlib.aclosing(stream.events()) as events:
            async for event in events:
                if event.error is not None:
                    yield _data(from_engine(event.error).body())
                    outcome = "server_error"
                    return
                for chunk in shaper.event_chunks(event):
                    yield _data(chunk)
                if event.is_final:
                    ctx.metrics.observe(served.name, event.usage)
        yield "[DONE]"
        outcome = "ok"
    finally:
        slot.release()
        ctx.metrics.count(ENDPOINT, outcome)


def _data(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
