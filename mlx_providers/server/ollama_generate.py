"""``POST /api/generate``: Ollama's one-prompt generation, through the shared flow.

Three kinds of prompt, as Ollama reads them:

- by default ``prompt`` (with ``images``) is a user turn after ``system`` (if given),
  rendered with the model's chat template: a ``ChatRequest``, as ``/api/chat`` sends;
- ``raw``: the prompt is continued as it is, no template (``system`` is ignored, as
  Ollama ignores it; images cannot go in raw text and are refused);
- ``suffix``: fill-in-the-middle, the prompt as the prefix, laid out in the tokenizer's
  FIM markers (``fim``) and continued raw; a tokenizer without them refuses it (400),
  as Ollama refuses ``suffix`` for a model without the "insert" capability.

``template`` (a Go template of Ollama's) is refused unless empty: the model's own chat
template renders prompts here, and a template silently ignored would change the prompt.
``context`` (the deprecated token history) is accepted and ignored. A request with no
prompt, suffix, system or images loads (or, ``keep_alive`` 0, unloads) the model
(``ollama_load``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from engine import ChatRequest, SamplingParams, TextRequest
from engine import Request as EngineRequest
from mlx_providers.server.context import ServerContext, off_loop, read_json, validate
from mlx_providers.server.errors import APIError, from_engine
from mlx_providers.server.fim import NoFimTokens, fill_in_the_middle
from mlx_providers.server.generation import Endpoint, serve
from mlx_providers.server.ollama_answer import OllamaAnswer, Timing
from mlx_providers.server.ollama_errors import ollama_route
from mlx_providers.server.ollama_load import load_or_unload
from mlx_providers.server.ollama_request import (
    OllamaGenerateRequest,
    format_constraint,
    image_content,
    sampling,
    served_model,
    think_template,
)
from mlx_providers.server.ollama_stream import NDJSONResponse
from mlx_providers.server.served import ServedModel

ENDPOINT = "ollama_generate"
PARAMS = {"prompt_param": "prompt", "max_tokens_param": "options.num_predict"}
_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?(.*)")


@ollama_route(ENDPOINT)
async def ollama_generate(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = validate(OllamaGenerateRequest,
                    await read_json(request, ctx.settings.max_body_bytes))
    served, adapter = served_model(ctx, body.model)
    timing = Timing(served.engine)  # before anything waits: the total counts from here
    if body.template:
        raise APIError(400, "template: Go templates are not supported; the model's own chat "
                       "template renders the prompt (send raw: true for a prompt of your own)",
                       param="template")
    if not (body.prompt or body.suffix or body.system or body.images):
        return await load_or_unload(served, "generate", body.model, body.keep_alive)
    if body.images and (body.raw or body.suffix):
        raise APIError(400, f"images: a {'suffix' if body.suffix else 'raw'} prompt is text "
                       "the model continues as it is, and images cannot go in it",
                       param="images")
    constraint = format_constraint(body.format)
    fields = _fields(bool(body.system), len(body.images or ()))
    try:
        params = sampling(body, default_max_tokens=ctx.settings.default_max_tokens,
                          default_temperature=ctx.settings.default_temperature,
                          constraint=constraint, adapter=adapter)
        if body.suffix:
            spec: EngineRequest = await _fill_in_middle(served, body, params)
        elif body.raw:
            spec = TextRequest(body.prompt or "", params)
        else:
            spec = await off_loop(bool(body.images), lambda: ChatRequest.from_openai(
                _messages(body), params, chat_template_kwargs=think_template(body.think)))
    except ValueError as exc:  # the rulebook's refusals (a bad image, a bad option)
        raise from_engine(exc, fields=fields, **PARAMS) from exc
    endpoint = Endpoint(ENDPOINT, ctx.metrics, {**PARAMS, "constraint_param": "format"},
                        fields=fields)
    answer = OllamaAnswer("generate", body.model, timing,
                          token_text=served.token_text if spec.params.logprobs else None)
    return await serve(request, endpoint, served, spec, answer, stream=body.stream,
                       fit_context=body.options.max_tokens is None,
                       keep_alive=body.keep_alive, stream_response=NDJSONResponse)


def _messages(body: OllamaGenerateRequest) -> list[dict[str, Any]]:
    """The chat turn(s) a templated prompt is: ``system``, then the prompt with images."""
    system = [{"role": "system", "content": body.system}] if body.system else []
    return [*system, {"role": "user", "content": image_content(body.prompt or "",
                                                               body.images)}]


async def _fill_in_middle(served: ServedModel, body: OllamaGenerateRequest,
                          params: SamplingParams) -> TextRequest:
    """The FIM prompt as token ids, its family's end-of-middle markers as stop tokens."""
    tokenizer = await anyio.to_thread.run_sync(lambda: served.engine.tokenizer)
    try:
        ids, ends = fill_in_the_middle(tokenizer, body.prompt or "", body.suffix or "")
    except NoFimTokens as exc:
        raise APIError(400, f"suffix: {body.model!r} does not support insert: {exc}",
                       param="suffix") from exc
    return TextRequest(tuple(ids), replace(params, stop_token_ids=(*params.stop_token_ids, *ends)))


def _fields(system: bool, images: int) -> Callable[[str], str]:
    """The rulebook's field names (the chat turns ``_messages`` built) as this request's:
    the user turn's image parts are ``images[k]``, its text ``prompt``, the rest
    ``system``."""
    user = 1 if system else 0

    def field(name: str) -> str:
        if name == "messages":
            return "prompt"
        found = _MESSAGE_FIELD.fullmatch(name)
        if found is None:
            return name
        if int(found.group(1)) != user:
            return "system"
        part = found.group(2)
        return f"images[{part}]" if part is not None and int(part) < images else "prompt"

    return field
