"""``POST /api/chat``: Ollama's chat, through the same generation flow as every door.

Validated (``ollama_request``), converted once by the engine's rulebook
(``ChatRequest.from_openai``: messages, tools, ``format`` as the output constraint,
``think`` as template variables), then ``generation.serve`` runs it: admission, the
engine's refusals as 4xx before any byte is sent, the whole answer or an NDJSON stream
(the default, as in Ollama), cancel on disconnect. A request without messages loads (or,
``keep_alive`` 0, unloads) the model (``ollama_load``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from engine import ChatRequest
from mlx_providers.server.context import ServerContext, off_loop, read_json, validate
from mlx_providers.server.errors import from_engine
from mlx_providers.server.generation import Endpoint, serve
from mlx_providers.server.ollama_answer import OllamaAnswer, Timing
from mlx_providers.server.ollama_errors import ollama_route
from mlx_providers.server.ollama_load import load_or_unload
from mlx_providers.server.ollama_request import (
    MessageFields,
    OllamaChatRequest,
    chat_tools,
    format_constraint,
    openai_messages,
    sampling,
    served_model,
    think_template,
)
from mlx_providers.server.ollama_stream import NDJSONResponse

ENDPOINT = "ollama_chat"
# Where the engine's refusals point, in this request's names.
PARAMS = {"prompt_param": "messages", "max_tokens_param": "options.num_predict"}


@ollama_route(ENDPOINT)
async def ollama_chat(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = validate(OllamaChatRequest, await read_json(request, ctx.settings.max_body_bytes))
    served, adapter = served_model(ctx, body.model)
    timing = Timing(served.engine)  # before anything waits: the total counts from here
    if not body.messages:
        return await load_or_unload(served, "chat", body.model, body.keep_alive)
    fields = MessageFields()  # where each image went, for the rulebook's refusals
    constraint = format_constraint(body.format)

    def convert() -> ChatRequest:
        """The engine's request (on a worker thread when images are decoded)."""
        params = sampling(body, default_max_tokens=ctx.settings.default_max_tokens,
                          default_temperature=ctx.settings.default_temperature,
                          constraint=constraint, adapter=adapter)
        return ChatRequest.from_openai(openai_messages(body.messages, fields), params,
                                       tools=chat_tools(body.tools),
                                       chat_template_kwargs=think_template(body.think))

    try:
        spec = await off_loop(any(m.images for m in body.messages), convert)
    except ValueError as exc:  # the rulebook's refusals (a bad image, a malformed call)
        raise from_engine(exc, fields=fields.ollama_field, **PARAMS) from exc
    # A grammar that does not compile is the format's when there is one, else a tool's.
    endpoint = Endpoint(ENDPOINT, ctx.metrics, {
        **PARAMS, "constraint_param": "format" if spec.params.constraint else "tools"},
        fields=fields.ollama_field)
    answer = OllamaAnswer("chat", body.model, timing,
                          token_text=served.token_text if spec.params.logprobs else None)
    return await serve(request, endpoint, served, spec, answer, stream=body.stream,
                       fit_context=body.options.max_tokens is None,
                       keep_alive=body.keep_alive, stream_response=NDJSONResponse)
