"""``/v1/responses``: create (whole or streamed), retrieve and delete stored responses."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import EngineError, sampling_from_openai
from mlx_providers.server.chat_completions import ChatCompletionShaper
from mlx_providers.server.context import ServerContext, read_json, validate
from mlx_providers.server.errors import APIError, from_engine, not_found
from mlx_providers.server.generation import (
    ClientGone,
    EventStream,
    GenerationSpec,
    open_stream,
    unless_disconnected,
)
from mlx_providers.server.responses_events import ResponseTranslator
from mlx_providers.server.responses_request import ResponsesRequest, messages_of
from mlx_providers.server.served import Slot

log = logging.getLogger(__name__)
ENDPOINT = "responses"
CLIENT_CLOSED = 499
# Where engine errors point for this endpoint's parameter names.
_PARAMS = {"prompt_param": "input", "max_tokens_param": "max_output_tokens"}


def _echo(req: ResponsesRequest, max_output_tokens: int, temperature: float) -> dict[str, Any]:
    """The request fields a response object repeats."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if (
        req.text and req.text.format) else {"type": "text"}
    choice = req.tool_choice
    return {"instructions": req.instructions, "max_output_tokens": max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": temperature, "text": {"format": fmt},
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(
                choice, str) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": "disabled",
            "metadata": req.metadata or {}, "user": None}


class _Run:
    """One response being generated: the request, its history, its translator, its slot."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest,
                 items: list[dict[str, Any]], translator: ResponseTranslator,
                 shaper: ChatCompletionShaper, slot: Slot) -> None:
        self.ctx, self.req, self.items = ctx, req, items
        self.translator, self.shaper, self.slot = translator, shaper, slot

    def store(self) -> None:
        if self.req.store and not self.ctx.store.put(
                self.translator.id, input_items=self.items,
                output_items=self.translator.output, instructions=self.req.instructions,
                response=self.translator.response()):
            log.warning("response %s is larger than the store's byte cap (%d): not stored",
                        self.translator.id, self.ctx.store.max_bytes)

    async def whole(self, stream: EventStream) -> dict[str, Any]:
        """Run to the end (errors raise); the final response object."""
        async with contextlib.aclosing(stream.events()) as events:
            async for event in events:
                if event.error is not None:
                    raise event.error
                for chunk in self.shaper.event_chunks(event):
                    self.translator.feed(chunk)
                if event.is_final:
                    self.ctx.metrics.observe(self.translator.model, event.usage)
        return self.translator.response()

    async def events(self, stream: EventStream) -> AsyncIterator[dict[str, str]]:
        """SSE events; a failure sends ``error`` and ends the stream cleanly."""
        outcome = "disconnected"
        translator = self.translator
        try:
            for event in translator.start():
                yield _sse(event)
            async with contextlib.aclosing(stream.events()) as engine_events:
                async for engine_event in engine_events:
                    if engine_event.error is not None:
                        for event in translator.fail(str(engine_event.error)):
                            yield _sse(event)
                        outcome = "server_error"
                        return
                    for chunk in self.shaper.event_chunks(engine_event):
                        for event in translator.feed(chunk):
                            yield _sse(event)
                    if engine_event.is_final:
                        self.ctx.metrics.observe(translator.model, engine_event.usage)
            outcome = "ok"
        finally:
            if not translator.done:
                translator.cancel()
            self.store()
            self.slot.release()
            self.ctx.metrics.count(ENDPOINT, outcome)


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"],
            "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


async def create_response(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    req = validate(ResponsesRequest, await read_json(request, ctx.settings.max_body_bytes))
    served = ctx.models.get(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = ctx.store.get(req.previous_response_id)
        if stored is None:
            raise not_found(f"previous response {req.previous_response_id!r} was not found "
                            "(unknown, expired or deleted)", param="previous_response_id")
        history = stored.history()  # its instructions are not carried over, as in OpenAI's
    items = [*history, *req.input_items()]
    max_tokens = req.max_output_tokens or ctx.settings.default_max_tokens
    temperature = (req.temperature if req.temperature is not None
                   else ctx.settings.default_temperature)
    try:
        params = sampling_from_openai(max_tokens=max_tokens, temperature=temperature,
                                      top_p=req.top_p, constraint=req.constraint())
    except ValueError as exc:  # SamplingParams' own checks
        raise from_engine(exc, **_PARAMS) from exc
    spec = GenerationSpec(messages_of(items, req.instructions), params, req.engine_tools(),
                          req.engine_tool_choice(), req.parallel_tool_calls)
    errors = {**_PARAMS, "constraint_param": "text.format" if spec.params.constraint
              else "tools"}
    translator = ResponseTranslator(served.name, _echo(req, max_tokens, temperature))
    shaper = ChatCompletionShaper(served.name, served.token_text, include_usage=True)
    slot = served.admit()
    run = _Run(ctx, req, items, translator, shaper, slot)
    streaming = False
    try:
        try:
            stream = await open_stream(request, served.engine, spec,
                                       fit_context=req.max_output_tokens is None)
        except (ValueError, TypeError, EngineError) as exc:  # bad input, or a dead engine
            raise from_engine(exc, **errors) from exc
        if stream.first.error is not None:
            raise from_engine(stream.first.error, **errors)
        if not req.stream:
            try:
                response = await unless_disconnected(request, stream.handle,
                                                     lambda: run.whole(stream))
            except (ClientGone, APIError):
                raise
            except Exception as exc:
                raise from_engine(exc, **errors) from exc
            run.store()
            ctx.metrics.count(ENDPOINT, "ok")
            return JSONResponse(response)
        streaming = True  # from here on the stream stores and releases
        return EventSourceResponse(run.events(stream))
    except ClientGone:
        ctx.metrics.count(ENDPOINT, "disconnected")
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not streaming:
            slot.release()


async def get_response(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    response_id = request.path_params["response_id"]
    stored = ctx.store.get(response_id)
    if stored is None:
        raise not_found(f"response {response_id!r} was not found (unknown, expired or "
                        "deleted)", param="response_id")
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    response_id = request.path_params["response_id"]
    if not ctx.store.delete(response_id):
        raise not_found(f"response {response_id!r} was not found", param="response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
