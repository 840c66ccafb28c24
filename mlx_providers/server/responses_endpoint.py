"""``/v1/responses``: create (whole or streamed), retrieve and delete stored responses."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import ChatRequest, StreamEvent
from mlx_providers.server.context import (
    ServerContext,
    has_images,
    off_loop,
    read_json,
    route_model,
    validate,
)
from mlx_providers.server.errors import from_engine, not_found
from mlx_providers.server.generation import Endpoint, serve
from mlx_providers.server.request_options import body_sampling
from mlx_providers.server.responses_events import ResponseTranslator
from mlx_providers.server.responses_request import (
    InputFields,
    ResponsesRequest,
    input_messages,
)

log = logging.getLogger(__name__)
ENDPOINT = "responses"
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
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store,
            "temperature": temperature, "text": {"format": fmt},
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(
                choice, str) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs,
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": "disabled",
            "metadata": req.metadata or {}, "user": None}


class ResponsesAnswer:
    """The Responses side of ``generation.serve``: events as SSE, or the whole response;
    stored when it ends (a stream whose reader left is stored as cancelled)."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest,
                 items: list[dict[str, Any]], translator: ResponseTranslator) -> None:
        self.ctx, self.req, self.items, self.translator = ctx, req, items, translator

    def start(self) -> list[dict[str, str]]:
        return [_sse(event) for event in self.translator.start()]

    def feed(self, event: StreamEvent) -> list[dict[str, str]]:
        return [_sse(item) for item in self.translator.feed(event)]

    def fail(self, error: BaseException) -> list[dict[str, str]]:
        return [_sse(event) for event in self.translator.fail(str(error))]

    def end(self) -> list[dict[str, str]]:
        return []

    def body(self) -> dict[str, Any]:
        return self.translator.response()

    def close(self, outcome: str) -> None:
        if not self.translator.done:
            self.translator.cancel()
        if self.req.store and not self.ctx.store.put(
                self.translator.id, input_items=self.items,
                output_items=self.translator.output, instructions=self.req.instructions,
                response=self.translator.response()):
            log.warning("response %s is larger than the store's byte cap (%d): not stored",
                        self.translator.id, self.ctx.store.max_bytes)


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"],
            "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


async def create_response(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    req = validate(ResponsesRequest, await read_json(request, ctx.settings.max_body_bytes))
    served, adapter = route_model(ctx, req.model, req.adapter)
    req = req.model_copy(update={"adapter": adapter})
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
    fields = InputFields()  # where the rulebook's message fields are in this request

    def convert() -> ChatRequest:
        """The engine's request (on a worker thread when images are decoded)."""
        nonlocal fields  # kept for the refusals from_openai raises too
        messages, fields = input_messages(items, req.instructions, history=len(history))
        return ChatRequest.from_openai(
            messages, params, tools=req.engine_tools(), tool_choice=req.engine_tool_choice(),
            parallel_tool_calls=req.parallel_tool_calls,
            chat_template_kwargs=req.template_kwargs())

    try:
        params = body_sampling(req, max_tokens=max_tokens, temperature=temperature,
                               constraint=req.constraint(), logprobs=req.logprobs)
        spec = await off_loop(has_images(items), convert)
    except ValueError as exc:  # the rulebook's refusals (a bad tool, SamplingParams' checks)
        raise from_engine(exc, fields=fields.responses_field, **_PARAMS) from exc
    endpoint = Endpoint(ENDPOINT, ctx.metrics, {
        **_PARAMS, "constraint_param": "text.format" if spec.params.constraint else "tools"},
        fields=fields.responses_field)
    translator = ResponseTranslator(served.name, _echo(req, max_tokens, temperature),
                                    token_text=served.token_text if req.logprobs else None)
    answer = ResponsesAnswer(ctx, req, items, translator)
    return await serve(request, endpoint, served, spec, answer, stream=req.stream,
                       fit_context=req.max_output_tokens is None, keep_alive=req.keep_alive)


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
