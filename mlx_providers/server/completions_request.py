"""``POST /v1/completions`` requests (OpenAI's legacy API): validation, then the rows.

A request is one or more prompts, each text or token ids, continued as they are (no chat
template: the engine's ``TextRequest``). Each prompt is run ``n`` times, one engine row a
choice, all submitted together so they batch; choice ``i * n + j`` is prompt ``i``'s
``j``-th. ``suffix`` asks for the middle between a prompt and a suffix, laid out in the
model's own fill-in-the-middle tokens (``fim.py``). What this server cannot do is a 400
naming the parameter and why: ``echo`` beside ``logprobs`` (the engine computes no prompt
tokens' logprobs), ``best_of`` other than ``n`` (no candidates are ranked), a ``suffix``
for a tokenizer without FIM tokens. OpenAI's ``frequency_penalty``, ``presence_penalty``,
``logit_bias`` and ``user`` are accepted and ignored, as the chat door ignores the
parameters it does not have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import Field, StrictInt, StrictStr

from engine import SamplingParams, TextRequest
from mlx_providers.server.chat_request import AgentOptions, StreamOptions
from mlx_providers.server.errors import APIError
from mlx_providers.server.fim import NoFimTokens, fill_in_the_middle
from mlx_providers.server.request_options import body_sampling

DEFAULT_MAX_TOKENS = 16  # the legacy API's own default, not the chat door's
_SEEDS = 2**64  # SamplingParams' seed range: a choice's seed wraps inside it

Prompt = str | tuple[int, ...]  # one prompt: text, or token ids


class CompletionRequest(AgentOptions):
    """The parameters this server honours; the rest are accepted and ignored."""

    model: str
    # Text, several texts, token ids, or several lists of them (the SDK's four shapes).
    # Strict: a list of digit strings is texts, never token ids.
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    suffix: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    # The legacy shape: how many alternatives per token (0: the chosen token's only).
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # This server's, as on chat completions (vLLM's names): sampling options OpenAI's API
    # does not have (the agent options every door takes: ``AgentOptions``).
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None

    @property
    def choices(self) -> int:
        """Choices per prompt (``n``)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompts(self) -> list[Prompt]:
        """Each prompt, checked: none empty (the engine needs a token to continue)."""
        prompt = self.prompt
        items: list[Prompt] = []
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [tuple(p for p in prompt if isinstance(p, int))]
        else:
            for p in prompt:
                items.append(p if isinstance(p, str) else tuple(p) if isinstance(p, list)
                             else (p,))
        if not items:
            raise APIError(400, "prompt: give a prompt (text or token ids), or a list of them",
                           param="prompt", code="invalid_value")
        for i, item in enumerate(items):
            if not item:
                where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                raise APIError(400, f"{where}: empty; give at least one character or token",
                               param=where, code="invalid_value")
        return items


def refusals(request: CompletionRequest, capacity: int) -> None:
    """What this server cannot do for a request, as a 400 naming the parameter."""
    if request.echo and request.logprobs is not None:
        raise APIError(400, "echo: with logprobs it asks for the prompt tokens' logprobs, "
                       "which this server's engine does not compute (it scores generated "
                       "tokens only); ask for echo or for logprobs", param="echo",
                       code="unsupported_value")
    if request.best_of is not None and request.best_of != request.choices:
        raise APIError(400, f"best_of: only best_of equal to n ({request.choices}) is "
                       "served: this server returns every choice it generates and ranks "
                       "none", param="best_of", code="unsupported_value")
    rows = len(request.prompts()) * request.choices
    if rows > capacity:
        raise APIError(400, f"prompt: {rows} choices (prompts x n) are more than this model "
                       f"runs and queues at once ({capacity})", param="prompt",
                       code="invalid_value")


@dataclass(frozen=True)
class CompletionRows:
    """What the engine is asked, a row per choice, and each choice's echoed prompt text."""

    specs: list[TextRequest]
    echoes: list[str]  # "" without echo


def needs_tokenizer(request: CompletionRequest) -> bool:
    """Whether building the rows reads the tokenizer (a worker thread's work): a FIM
    prompt, or token ids to echo as text."""
    return request.suffix is not None or bool(
        request.echo and any(not isinstance(p, str) for p in request.prompts()))


def completion_rows(request: CompletionRequest, tokenizer: Callable[[], Any], *,
                    default_temperature: float) -> CompletionRows:
    """The engine requests (a row per choice) and echoes; ``tokenizer`` is called only
    when the rows need it (``needs_tokenizer``)."""
    prompts = request.prompts()
    stops: tuple[int, ...] = ()
    engine_prompts: list[Prompt] = list(prompts)
    if request.suffix is not None:
        try:
            built = [fill_in_the_middle(tokenizer(), p, request.suffix) for p in prompts]
        except NoFimTokens as exc:
            raise APIError(400, f"suffix: {exc}", param="suffix",
                           code="unsupported_value") from exc
        engine_prompts = [tuple(ids) for ids, _ in built]
        stops = built[0][1]
    temperature = (request.temperature if request.temperature is not None
                   else default_temperature)
    params = body_sampling(request, max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
                           temperature=temperature, logprobs=request.logprobs is not None,
                           top_logprobs=request.logprobs or 0,
                           **({"stop_token_ids": stops} if stops else {}))
    try:
        specs = [TextRequest(prompt, _choice(params, j))
                 for prompt in engine_prompts for j in range(request.choices)]
    except ValueError as exc:  # token ids past 2**31 (those past the vocabulary: at prepare)
        raise APIError(400, f"prompt: {exc}", param="prompt", code="invalid_value") from exc
    echoes = [_echo(request, prompt, tokenizer) for prompt in prompts
              for _ in range(request.choices)]
    return CompletionRows(specs, echoes)


def _choice(params: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j``'s sampling: a seeded request's choices each get their own seed (the
    next ones), else ``n`` seeded choices would be one sample ``n`` times."""
    if j == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + j) % _SEEDS)


def _echo(request: CompletionRequest, prompt: Prompt, tokenizer: Callable[[], Any]) -> str:
    """The text ``echo`` puts before a choice's completion: the prompt as sent, token ids
    as the tokenizer decodes them."""
    if not request.echo:
        return ""
    if isinstance(prompt, str):
        return prompt
    return str(tokenizer().decode(list(prompt)))

