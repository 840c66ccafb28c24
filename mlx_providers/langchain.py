"""``ChatMLXBatch``: a LangChain chat model whose requests are rows of one shared batch.

Every ``ChatMLXBatch`` for the same model in a process talks to the same engine
(``engine.get_engine``), so concurrent chains, ``abatch`` fan-outs, parallel branches and
threads decode together without the caller doing anything. All four LangChain paths
(``_generate``, ``_stream``, ``_agenerate``, ``_astream``) are native: leaving early
(task cancellation, ``break``, closing a stream, a timeout) evicts the request's row.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Literal, cast

import anyio
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams, LanguageModelInput, ModelProfile
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from pydantic import Field, field_validator, model_validator

from engine import (
    REQUEST_OPTIONS,
    ChatRequest,
    Completion,
    Engine,
    EngineConfig,
    InvalidRequestError,
    JsonObject,
    JsonSchema,
    RequestHandle,
    SamplingParams,
    StreamEvent,
    declared_model,
    get_engine,
    messages_from_openai,
)
from mlx_providers._keep_alive import submit_options
from mlx_providers._langchain_inbound import (
    ToolLike,
    carries_images,
    chat_messages,
    constraint_for,
    json_schema_of,
    tool_choice_name,
    tool_specs,
)
from mlx_providers._langchain_outbound import chat_generation, event_chunk
from mlx_providers._langchain_structured import structured_parser, unless_called, with_raw
from mlx_providers._logprobs import RequestLogprobs
from mlx_providers._sampling import call_sampling

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the engine loads for model=None
# Standard LangChain arguments that mean nothing for an in-process model: accepted quietly.
_REMOTE_ONLY = frozenset({"api_key", "base_url", "max_retries"})
# The engine's request options, each a field and a per-call option; LangChain passes
# ``stop`` as its own argument.
_SAMPLING = tuple(name for name in REQUEST_OPTIONS if name != "stop")
_REQUEST_KWARGS = frozenset({*_SAMPLING, "model", "timeout", "tools", "tool_choice",
                             "parallel_tool_calls", "response_format", "constraint",
                             "reasoning", "chat_template_kwargs",
                             "raise_on_truncated_call",
                             "stream"})
StructuredMethod = Literal["function_calling", "json_schema", "json_mode"]


@dataclass(frozen=True)
class _Request:
    """Everything one call sends to the engine, resolved from fields and call kwargs."""

    engine: Engine
    model_name: str
    is_own_model: bool
    chat: ChatRequest  # the engine's request value, built once; submitted as it is
    timeout: float | None
    raise_on_truncated_call: bool = True
    keep_alive: float | None = None  # ChatMLXBatch.keep_alive (negative: keep loaded)

    def submit(self) -> RequestHandle:
        return self.engine.submit(self.chat, timeout=self.timeout,
                                  **submit_options(self.keep_alive))

    @cached_property
    def logprobs(self) -> RequestLogprobs:
        """Its tokens' logprobs in OpenAI's shape (None unless it asked for them)."""
        return RequestLogprobs(self.engine, self.chat.params.logprobs)


class ChatMLXBatch(BaseChatModel):
    """A local MLX chat model on the process-wide continuous-batching engine.

    Construction is cheap; the model loads on first use. ``chat.engine`` is the shared
    engine (``chat.engine.stats()`` shows the batch). Example::

        chat = ChatMLXBatch(max_tokens=64)
        answers = await asyncio.gather(*(chat.ainvoke(q) for q in questions))  # one batch
    """

    model: str | None = None
    """A local mlx-lm model directory, a ``.gguf`` file, a hub id, or None (the default
    model, SmolLM2-135M-Instruct)."""
    temperature: float = Field(default=0.0, ge=0)
    """0 is greedy (deterministic, and batched rows match single runs token for token)."""
    max_tokens: int = Field(default=256, ge=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, lt=1)
    repetition_penalty: float | None = None
    seed: int | None = None
    """With temperature > 0, reproducible sampling (such rows run on the serial lane)."""
    stop: list[str] | None = None
    """Stop strings (matched on text across tokens, never streamed)."""
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Seconds after which a request is evicted and ``RequestTimeoutError`` raised."""
    streaming: bool = False
    """Route ``invoke`` through the streaming path (LangChain's standard flag)."""
    reasoning: bool | None = None
    """Thinking on/off for templates that support it (``enable_thinking``); None = default."""
    reasoning_budget: int | None = Field(default=None, ge=0)
    """At most this many reasoning tokens, then the reasoning block is closed by the grammar
    and the answer (and its tools or schema) follows; None = unbounded."""
    repeat_answered_calls: bool = False
    """With tools beside a response format, the grammar refuses a call that repeats one the
    history already answered (same tool and arguments, a ToolMessage for it): the model
    calls something else or answers. True admits such repeats."""
    adapter: str | None = None
    """A LoRA adapter directory (mlx-lm's format: ``adapter_config.json`` and
    ``adapters.safetensors``) this model's replies use, loaded once; chat models with
    different adapters on one base share its batch and its weights. None: the base."""
    tool_call_limit: int | None = Field(default=None, ge=1)
    """Calls to each tool the conversation may hold answered before the tool is no longer
    offered to a grammar-decided reply (tools beside a response format, or a required
    call, as ``create_agent``'s two strategies send): a small model that keeps calling
    then answers. None = no limit. It does not apply to a free-text reply (``auto``
    without a response format), where no grammar decides."""
    logprobs: bool = False
    """Each generated token's log-probability in ``response_metadata["logprobs"]``, in
    ChatOpenAI's shape (``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``);
    each streamed chunk carries its own tokens'."""
    top_logprobs: int = 0
    """With ``logprobs``, this many most likely alternatives per token (0-20)."""
    chat_template_kwargs: dict[str, Any] | None = None
    keep_alive: float | None = Field(default=None, allow_inf_nan=False)
    """Seconds the model stays loaded once the engine is idle after each request made here
    (0: unloaded right after; negative: kept loaded), as ``ChatOllama``'s; the engine's
    latest request decides. None = the engine's ``EngineConfig.keep_alive``."""
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """``EngineConfig`` fields for the shared engine (empty = reuse it as configured)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_remote_only_arguments(cls, values: Any) -> Any:
        # Unknown arguments would be ignored silently by pydantic; say so, except for the
        # standard remote-API ones that are meaningless here.
        if isinstance(values, dict):
            unknown = set(values) - set(cls.model_fields) - _REMOTE_ONLY
            aliases = {f.alias for f in cls.model_fields.values() if f.alias}
            if unknown - aliases:
                warnings.warn(f"ChatMLXBatch ignores unknown arguments "
                              f"{sorted(unknown - aliases)}", stacklevel=4)
            values = {k: v for k, v in values.items() if k not in _REMOTE_ONLY}
        return values

    @field_validator("model", mode="before")
    @classmethod
    def _model_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("engine_config", mode="before")
    @classmethod
    def _valid_engine_config(cls, value: Any) -> dict[str, Any]:
        # Validate now (cheap) so a typo fails at construction, not at first use.
        if value is None:
            return {}
        if isinstance(value, EngineConfig):
            return value.model_dump()
        if not isinstance(value, Mapping):  # pydantic reports a ValueError, not a TypeError
            raise ValueError(f"engine_config must be a dict of EngineConfig fields or an "
                             f"EngineConfig, got {type(value).__name__}")
        EngineConfig(**value)
        return dict(value)

    @model_validator(mode="after")
    def _valid_sampling(self) -> ChatMLXBatch:
        # Bad sampling defaults fail at construction, naming the field, not at first call.
        SamplingParams(**{name: getattr(self, name) for name in _SAMPLING},
                       stop=tuple(self.stop or ()))
        return self

    # ----- identity, tracing, profile ---------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "mlx-batch-chat"

    @property
    def model_name(self) -> str:
        """The model as reported to callbacks and tracers."""
        return _display_name(self.model)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "seed": self.seed, "stop": self.stop, "reasoning": self.reasoning,
                "logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "mlx"
        model = kwargs.get("model")
        params["ls_model_name"] = _display_name(model) if model else self.model_name
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        # Complete from construction, so middleware built before the first request can read
        # it (SummarizationMiddleware's fractional triggers need max_input_tokens): the
        # context limit and reasoning markers the model declares, read from its files
        # without loading, converting or downloading it (``engine.declared_model``).
        declared = declared_model(self.model)
        profile: dict[str, Any] = {
            "name": self.model_name, "open_weights": True,
            "text_inputs": True, "image_inputs": False, "image_url_inputs": False,
            "pdf_inputs": False, "audio_inputs": False, "video_inputs": False,
            "image_tool_message": False, "pdf_tool_message": False,
            "text_outputs": True, "image_outputs": False, "audio_outputs": False,
            "video_outputs": False, "tool_calling": True, "tool_choice": True,
            "tool_call_streaming": True, "mid_conversation_tools": False,
            "structured_output": True,  # with tools too: one grammar for a call or the answer
            "attachment": False, "temperature": True}
        if declared.image_inputs:  # base64 and data: URIs, in user and tool messages
            profile.update(image_inputs=True, image_tool_message=True)
        if declared.video_inputs:  # the Qwen-VL families: v1 video blocks, base64
            profile.update(video_inputs=True)
        if declared.audio_inputs:  # Gemma 4 with an audio tower: v1 audio blocks, base64
            profile.update(audio_inputs=True)
        if declared.context_limit is not None:
            profile["max_input_tokens"] = declared.context_limit
        if declared.reasoning is not None:
            profile["reasoning_output"] = declared.reasoning
        # Only the keys this langchain-core declares: it warns about any other.
        known = ModelProfile.__annotations__
        return cast(ModelProfile, {k: v for k, v in profile.items() if k in known})

    @property
    def engine(self) -> Engine:
        """The process-wide engine for this model (created, not loaded, on first access)."""
        return get_engine(self.model, **self.engine_config)

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        # OpenAI-shaped message dicts are read by the engine's rulebook, as at every other
        # door (LangChain's own coercion knows other role spellings and raises KeyError).
        # Its results are LangChain messages, converted once more by ``chat_messages``.
        if _openai_dicts(model_input):
            messages_from_openai(list(model_input))
        # LangChain's message coercion raises NotImplementedError for inputs it cannot
        # read ([(None,)], [b""]): a bad argument, so the caller gets a TypeError. A
        # message dict missing a key it requires (a tool call's "id") raises a bare
        # KeyError there: a bad value, so a ValueError naming it.
        try:
            return super()._convert_input(model_input)
        except NotImplementedError as exc:
            raise TypeError(f"input must be a string, messages or a PromptValue: {exc}") from exc
        except KeyError as exc:
            raise ValueError(f"an input message is missing the key {exc}") from exc

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None,
                      *, stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        """``BaseChatModel.ainvoke``; message dicts with images are read off the loop."""
        converted = await self._aconvert_input(input)
        return await super().ainvoke(converted, config, stop=stop, **kwargs)

    async def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None,
                      *, stop: list[str] | None = None,
                      **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        """``BaseChatModel.astream``; message dicts with images are read off the loop."""
        converted = await self._aconvert_input(input)
        async for chunk in super().astream(converted, config, stop=stop, **kwargs):
            yield chunk

    async def _aconvert_input(self, model_input: LanguageModelInput,
                              ) -> LanguageModelInput:
        """``_convert_input`` on a worker thread for OpenAI dicts carrying images (the
        rulebook's check decodes them; a 12 MP PNG took the loop 0.86 s), else as given
        (LangChain converts it on the loop, without decoding anything)."""
        if _openai_dicts(model_input) and carries_images(list(model_input)):  # type: ignore[arg-type]
            return await anyio.to_thread.run_sync(self._convert_input, model_input)
        return model_input

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the model's tokenizer (loads the model)."""
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Prompt tokens of a history, rendered exactly as a request would be (tools too)."""
        return self.engine.count_tokens(ChatRequest.from_openai(
            chat_messages(messages), tools=tool_specs(tools).specs if tools else None,
            chat_template_kwargs=self._template_kwargs(None, None)))

    # ----- the four paths ---------------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """One request, waited for on this thread (``invoke``, ``batch``)."""
        request = self._request(messages, stop, kwargs)
        handle = request.submit()
        try:
            completion = handle.result()
        except BaseException:  # KeyboardInterrupt and friends: free the row
            handle.cancel()
            raise
        return self._result(request, completion)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """One request, awaited without a thread (``ainvoke``, ``abatch``)."""
        request = await self._arequest(messages, stop, kwargs)
        handle = request.submit()
        try:
            completion = await handle.aresult()  # task cancellation cancels the row
        except BaseException:
            handle.cancel()
            raise
        return self._result(request, completion)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Chunks as the engine thread produces them (``stream``)."""
        request = self._request(messages, stop, kwargs)
        handle = request.submit()
        try:
            for event in handle:
                chunk = self._chunk(request, event)
                if chunk is not None:
                    yield chunk
        finally:  # a consumer that left early (break, close, error) evicts the row
            handle.cancel()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Chunks delivered to the event loop without a thread (``astream``)."""
        request = await self._arequest(messages, stop, kwargs)
        handle = request.submit()
        try:
            async for event in handle:
                chunk = self._chunk(request, event)
                if chunk is not None:
                    yield chunk
        finally:  # cancellation, aclose() or an abandoned generator evicts the row
            handle.cancel()

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """Like ``Runnable.batch``, but with one thread per input unless max_concurrency
        is set: the threads only wait on the engine, and every input becomes a row."""
        return super().batch(inputs, _one_thread_each(config, len(inputs)),
                             return_exceptions=return_exceptions, **kwargs)

    def batch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[LanguageModelInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> Iterator[tuple[int, AIMessage | Exception]]:
        """Like ``batch``: one waiting thread per input unless max_concurrency is set."""
        yield from super().batch_as_completed(  # type: ignore[call-overload]
            inputs, _one_thread_each(config, len(inputs)),
            return_exceptions=return_exceptions, **kwargs)

    # ----- tools and structured output --------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any LangChain tool, pydantic model, function or OpenAI dict).

        ``tool_choice``: "auto" (default), "none", "any"/"required"/True (some tool), or a
        tool name; the forcing ones are enforced by the engine's grammar, so the calls
        are always well-formed and match the tool's argument schema. A forced call that
        ``max_tokens`` cuts raises ``engine.OutputTruncatedError`` naming the limit (bind
        ``raise_on_truncated_call=False`` to get it in ``invalid_tool_calls`` instead).
        """
        if tool_choice is not None and not isinstance(tool_choice, str | bool | Mapping):
            # Refused before the tools are converted: no tool list makes it a choice.
            raise InvalidRequestError(f"tool_choice must be a str, bool or dict, got "
                                      f"{type(tool_choice).__name__} {tool_choice!r:.40}",
                                      "tool_choice")
        formatted = tool_specs(tools, strict=strict)  # the one conversion of these tools
        choice = tool_choice_name(tool_choice, formatted)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Outputs parsed into ``schema`` (pydantic, TypedDict, JSON schema, OpenAI tool).

        ``json_schema`` (default) constrains decoding with the schema's grammar,
        ``function_calling`` forces a call to a tool built from the schema, and
        ``json_mode`` constrains the output to any JSON object. An output cut at
        ``max_tokens`` raises ``engine.OutputTruncatedError`` (also an
        ``OutputParserException``) naming the limit. ``include_raw`` returns
        ``{"raw", "parsed", "parsing_error"}`` instead of raising on a parsing error.

        ``tools`` (with ``json_schema`` or ``json_mode``, as langchain-openai takes them):
        the model may call one of them instead of answering, in the same request; a reply
        that calls a tool parses to None (``include_raw`` keeps its calls in ``raw``).
        """
        tools = kwargs.pop("tools", None)
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        if tools and method == "function_calling":
            raise ValueError("tools go with method='json_schema' or 'json_mode' (the "
                             "schema is then the answer's, the tools the model may call)")
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            assert schema is not None
            tool = tool_specs([schema], strict=strict)
            # A cut call is the parser's to report, so include_raw keeps the raw message.
            llm = self.bind_tools(tool, tool_choice=tool.specs[0].name, parallel_tool_calls=False,
                                  strict=strict, ls_structured_output_format=trace,
                                  raise_on_truncated_call=False)
        elif method in ("json_schema", "json_mode"):
            constraint = (JsonSchema(json_schema_of(schema)) if schema is not None
                          and method == "json_schema" else JsonObject())
            llm = (self.bind_tools(tools, strict=strict, response_format=constraint,
                                   ls_structured_output_format=trace) if tools
                   else self.bind(response_format=constraint, ls_structured_output_format=trace))
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, "
                             f"got {method!r}")
        parser = structured_parser(schema, tool_output=method == "function_calling")
        if tools:
            parser = unless_called(parser)
        return with_raw(llm, parser) if include_raw else llm | parser

    # ----- requests -----------------------------------------------------------------------

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> _Request:
        """Resolve fields and per-call kwargs into one engine request (validated here)."""
        unknown = set(kwargs) - _REQUEST_KWARGS
        if unknown:
            raise TypeError(f"ChatMLXBatch got unexpected keyword arguments {sorted(unknown)}; "
                            f"supported: {sorted(_REQUEST_KWARGS - {'stream'})}")
        model = kwargs.get("model") or self.model
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(f"model must be a path or a hub id, got {type(model).__name__}")
        _check_call_options(kwargs)
        sampling = call_sampling(self, kwargs, _SAMPLING)
        constraint = kwargs.get("constraint") or constraint_for(kwargs.get("response_format"))
        # As given: SamplingParams names a stop that is not text or a list of text.
        stops: Any = (stop if stop is not None else self.stop) or ()
        params = SamplingParams(**sampling, stop=stops, constraint=constraint)
        # Bound tools were converted at bind time; tools passed per call (any LangChain
        # shape) are converted here, once.
        specs = tool_specs(kwargs["tools"]).specs if kwargs.get("tools") else ()
        choice = tool_choice_name(kwargs.get("tool_choice"), specs) if specs else None
        chat = ChatRequest(chat_messages(messages), params, specs, choice or "auto",
                           kwargs.get("parallel_tool_calls", True),
                           self._template_kwargs(kwargs.get("reasoning"),
                                                 kwargs.get("chat_template_kwargs")))
        return _Request(
            engine=get_engine(model, **self.engine_config),
            model_name=_display_name(model),
            is_own_model=model == self.model,
            chat=chat,
            timeout=kwargs.get("timeout", self.timeout),
            raise_on_truncated_call=bool(kwargs.get("raise_on_truncated_call", True)),
            keep_alive=self.keep_alive,
        )

    async def _arequest(self, messages: list[BaseMessage], stop: list[str] | None,
                        kwargs: dict[str, Any]) -> _Request:
        """``_request`` for the async paths: messages carrying images are converted on a
        worker thread, where their images are decoded, so the event loop never stalls."""
        if not carries_images(messages):
            return self._request(messages, stop, kwargs)
        return await anyio.to_thread.run_sync(partial(self._request, messages, stop, kwargs))

    def _template_kwargs(self, reasoning: bool | None,
                         extra: Mapping[str, Any] | None) -> dict[str, Any]:
        thinking = reasoning if reasoning is not None else self.reasoning
        out: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
        return {**out, **(self.chat_template_kwargs or {}), **(extra or {})}

    def _chunk(self, request: _Request, event: StreamEvent) -> ChatGenerationChunk | None:
        if event.error is not None:  # a failure or timeout ends in no final chunk
            raise event.error
        if event.completion is not None:
            self._note_loaded(request)
            _check_forced_call(request, event.completion)
        return event_chunk(event, request.model_name, request.logprobs(event.logprobs))

    def _result(self, request: _Request, completion: Completion) -> ChatResult:
        self._note_loaded(request)
        _check_forced_call(request, completion)
        return ChatResult(generations=[chat_generation(
            completion, request.model_name, request.logprobs(completion.logprobs))])

    def _note_loaded(self, request: _Request) -> None:
        # A model whose files did not declare its context limit (a hub id not cached yet)
        # has it once the engine has loaded the model.
        if not request.is_own_model:
            return
        limit = request.engine.stats().context_limit
        if self.profile is not None and limit and "max_input_tokens" not in self.profile:
            self.profile["max_input_tokens"] = limit


def _check_call_options(kwargs: Mapping[str, Any]) -> None:
    """Per-call options the engine does not see as given (they are merged or converted
    here first): each must be of the kind it names, or the error says which one."""
    tools = kwargs.get("tools")
    if tools and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
        raise TypeError(f"tools must be a list of tools, got {type(tools).__name__}")
    extra = kwargs.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict of template variables, got "
                        f"{type(extra).__name__}")
    reasoning = kwargs.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, bool):
        raise TypeError(f"reasoning must be None or a bool, got {type(reasoning).__name__}")
    for flag in ("raise_on_truncated_call", "parallel_tool_calls"):
        if flag in kwargs and not isinstance(kwargs[flag], bool):
            raise TypeError(f"{flag} must be a bool, got {type(kwargs[flag]).__name__}")


def _check_forced_call(request: _Request, completion: Completion) -> None:
    """A forced call that max_tokens cut raises ``OutputTruncatedError`` (unless the caller,
    e.g. ``with_structured_output``, reports it itself); the engine says it was cut."""
    if request.chat.forces_call and request.raise_on_truncated_call:
        error = completion.truncation_error()
        if error is not None:
            raise error


def _openai_dicts(model_input: Any) -> bool:
    """Whether an input is a list of OpenAI-shaped message dicts (each has a "role")."""
    return (isinstance(model_input, Sequence) and not isinstance(model_input, str)
            and bool(model_input)
            and all(isinstance(m, Mapping) and "role" in m for m in model_input))


def _one_thread_each(config: RunnableConfig | Sequence[RunnableConfig] | None,
                     count: int) -> list[RunnableConfig]:
    # LangChain's default pool has min(32, cores + 4) threads: 6 on two cores, which
    # would cap the batch at 6 rows. The threads only wait, so give each input one.
    return [c if c.get("max_concurrency") is not None
            else RunnableConfig(**{**c, "max_concurrency": max(1, count)})
            for c in get_config_list(config, count)]


def _display_name(model: str | os.PathLike[str] | None) -> str:
    if model is not None and not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a path or a hub id, got {type(model).__name__}")
    return DEFAULT_MODEL_NAME if model is None else os.fspath(model)


__all__ = ["ChatMLXBatch"]
