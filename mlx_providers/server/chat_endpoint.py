"""``POST /v1/chat/completions``: validate, then the shared generation flow answers."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from mlx_providers.server.chat_completions import ChatAnswer, ChatCompletionShaper
from mlx_providers.server.chat_request import ChatCompletionRequest, engine_request
from mlx_providers.server.context import (
    ServerContext,
    has_images,
    off_loop,
    read_json,
    route_model,
    validate,
)
from mlx_providers.server.errors import from_engine
from mlx_providers.server.generation import Endpoint, serve

ENDPOINT = "chat_completions"


async def chat_completions(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await read_json(request, ctx.settings.max_body_bytes)
    chat = validate(ChatCompletionRequest, body)
    served, adapter = route_model(ctx, chat.model, chat.adapter)
    chat = chat.model_copy(update={"adapter": adapter})
    try:
        spec = await off_loop(has_images(chat.messages), lambda: engine_request(
            chat, default_max_tokens=ctx.settings.default_max_tokens,
            default_temperature=ctx.settings.default_temperature))
    except ValueError as exc:  # the rulebook's refusals (a bad tool, an empty stop string)
        raise from_engine(exc) from exc
    # A grammar that does not compile is the schema's when there is one, else a tool's.
    endpoint = Endpoint(ENDPOINT, ctx.metrics, {
        "constraint_param": "response_format" if spec.params.constraint else "tools"})
    shaper = ChatCompletionShaper(served.name, served.token_text,
                                  include_usage=chat.include_usage, logprobs=chat.logprobs)
    return await serve(request, endpoint, served, spec, ChatAnswer(shaper), stream=chat.stream,
                       fit_context=chat.max_tokens is None and chat.max_completion_tokens is None,
                       keep_alive=chat.keep_alive)
