"""``POST /v1/completions``: validate, build a row per choice, then the shared flow answers."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from mlx_providers.server.completions_answer import CompletionsAnswer
from mlx_providers.server.completions_request import (
    CompletionRequest,
    completion_rows,
    needs_tokenizer,
    refusals,
)
from mlx_providers.server.context import ServerContext, off_loop, read_json, route_model, validate
from mlx_providers.server.generation import Endpoint, serve_rows

ENDPOINT = "completions"
# Where engine errors point: a prompt too long for the context is the prompt's.
_PARAMS = {"prompt_param": "prompt"}


async def completions(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await read_json(request, ctx.settings.max_body_bytes)
    completion = validate(CompletionRequest, body)
    served, adapter = route_model(ctx, completion.model, completion.adapter)
    completion = completion.model_copy(update={"adapter": adapter})
    refusals(completion, served.capacity)
    # The tokenizer (a FIM prompt, token ids to echo) is read on a worker thread: encoding
    # a long prompt must not stall the other connections.
    rows = await off_loop(needs_tokenizer(completion), lambda: completion_rows(
        completion, lambda: served.engine.tokenizer,
        default_temperature=ctx.settings.default_temperature))
    answer = CompletionsAnswer(served.name, served.token_text, rows.echoes,
                               logprobs=completion.logprobs is not None,
                               include_usage=completion.include_usage)
    return await serve_rows(request, Endpoint(ENDPOINT, ctx.metrics, _PARAMS), served,
                            rows.specs, answer, stream=bool(completion.stream),
                            fit_context=completion.max_tokens is None,
                            keep_alive=completion.keep_alive)
