"""MLXBatchLLM: a LlamaIndex ``FunctionCallingLLM`` on the shared continuous-batching engine.

Every call, sync or async, from any number of agents, query engines or threads, becomes
one row of the engine's running batch. The async methods are native: they await the
engine's stream and never run blocking code on the event loop. Cancelling the awaiting
task, abandoning a stream, or cancelling an agent run evicts the row at the next step.

    from mlx_providers import MLXBatchLLM
    llm = MLXBatchLLM()                       # the default model, SmolLM2-135M-Instruct
    print(llm.complete("The capital of France is"))
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import PydanticProgramMode

# The defining module: llama_index.core.instrumentation re-exports it only implicitly.
from llama_index_instrumentation import get_dispatcher
from pydantic import BaseModel

from engine import (
    REQUEST_OPTIONS,
    ChatRequest,
    Completion,
    Engine,
    InvalidRequestError,
    Message,
    RequestHandle,
    SamplingParams,
    StreamEvent,
    TextRequest,
    get_engine,
    normalize_tool_choice,
    normalize_tools,
)
from mlx_providers._keep_alive import submit_options
from mlx_providers._llama_index_agents import transcript_answer
from mlx_providers._llama_index_inbound import carries_images, to_engine_messages
from mlx_providers._llama_index_outbound import (
    StreamChunks,
    TokenLogProbs,
    chat_response,
    completion_response,
    llama_logprobs,
)
from mlx_providers._llama_index_structured import PartialObjects, json_kwargs, parse_structured
from mlx_providers._llama_index_tools import keep_first_call, tool_selections, tool_specs
from mlx_providers._logprobs import RequestLogprobs
from mlx_providers._sampling import call_sampling

__all__ = ["MLXBatchLLM"]

dispatcher = get_dispatcher(__name__)

# Per-call keyword arguments: sampling overrides, then what the engine's submit takes.
_PER_CALL = (*REQUEST_OPTIONS, "constraint", "timeout", "tools", "tool_choice",
             "parallel_tool_calls", "chat_template_kwargs")


@dataclass(frozen=True)
class _Request:
    """Everything one engine submit needs, built (and validated) before submitting: the
    engine's request value (converted once), the call's timeout, and its logprobs'
    conversion (None throughout unless it asked for them)."""

    request: ChatRequest | TextRequest
    timeout: float | None
    openai_logprobs: RequestLogprobs

    def logprobs(self, completion: Completion) -> TokenLogProbs | None:
        """The completion's logprobs as LlamaIndex's (None unless asked for)."""
        return llama_logprobs(self.openai_logprobs(completion.logprobs))

    @property
    def forces_call(self) -> bool:
        """A required or named tool: a call cut by max_tokens raises, naming the limit."""
        return isinstance(self.request, ChatRequest) and self.request.forces_call

    def checked(self, completion: Completion) -> Completion:
        """The completion, unless the engine says max_tokens cut a forced call."""
        if self.forces_call:
            error = completion.truncation_error()
            if error is not None:
                raise error
        return completion


def _text_request(prompt: str, params: SamplingParams, options: Mapping[str, Any]) -> TextRequest:
    """A completion: raw text, no chat template, so no tools (unless tool_choice is none)."""
    specs = normalize_tools(options.get("tools"))
    if specs and normalize_tool_choice(options.get("tool_choice"), specs) != "none":
        raise InvalidRequestError("tools need a chat-messages prompt", "tools")
    return TextRequest(prompt, params)


def _listed(items: Any, name: str) -> Sequence[Any]:
    """``items`` if it is a list-like of entries; a str, dict or single object is named."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence | Iterable):
        raise TypeError(f"{name} must be a list, got {type(items).__name__} {items!r:.40}")
    return list(items)


def _wait(handle: RequestHandle) -> Completion:
    """Block for the result; an interrupt (Ctrl-C) while waiting evicts the row."""
    try:
        return handle.result()
    except BaseException:
        handle.cancel()
        raise


class MLXBatchLLM(FunctionCallingLLM):
    """A local MLX model as a LlamaIndex function-calling LLM, batched with every other call.

    ``model`` is a local mlx-lm/HF directory, a ``.gguf`` file, a hub id, or None for the
    default model. All instances for one model share one engine (also with LangChain's
    ``ChatMLXBatch``). Sampling fields are defaults (``logprobs``/``top_logprobs`` among
    them: they fill a response's ``logprobs``); every call may override them, and
    may also pass ``constraint`` (an engine ``JsonSchema``/``JsonObject``/``Regex``/
    ``LarkGrammar``), ``timeout``, ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``chat_template_kwargs``. Structured output (``structured_predict``,
    ``as_structured_llm``) or a forced tool call (``tool_required``, a named
    ``tool_choice``) that ``max_tokens`` cuts raises ``engine.OutputTruncatedError``
    naming the limit; ``raw["finish_reason"]`` is "tool_calls" when the answer holds calls.
    """

    model: str | None = Field(
        default=None, description="Model directory, .gguf file or hub id; None = default model.")
    max_tokens: int = Field(default=DEFAULT_NUM_OUTPUTS, description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, description="0 is greedy (deterministic).")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(default=0, description="Sample among the k likeliest tokens (0 = off).")
    min_p: float = Field(default=0.0, description="Minimum probability relative to the top token.")
    repetition_penalty: float | None = Field(default=None, description="Penalty > 1 repeats less.")
    seed: int | None = Field(
        default=None, description="Reproducible sampling; seeded requests run one at a time.")
    stop: list[str] = Field(default_factory=list, description="Strings that end the output.")
    timeout: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="Seconds before a request is cancelled with an error.")
    logprobs: bool = Field(
        default=False, description="Each generated token's log-probability in the "
        "response's logprobs: one list per token, the chosen token first, then its "
        "top_logprobs alternatives (streamed responses: every token's so far).")
    top_logprobs: int = Field(
        default=0, description="With logprobs, this many most likely alternatives per "
        "token (0-20).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra chat-template variables (e.g. enable_thinking).")
    reasoning_budget: int | None = Field(
        default=None, ge=0, description="At most this many reasoning tokens when the chat "
        "template opens the reasoning block; then it is closed and the answer follows.")
    repeat_answered_calls: bool = Field(
        default=False, description="With tools beside output_cls, the grammar refuses a "
        "call that repeats one the history already answered (same tool and arguments, a "
        "tool result for it), so the model calls something else or answers; True admits it.")
    adapter: str | None = Field(
        default=None, description="A LoRA adapter directory (mlx-lm's format) this LLM's "
        "replies use, loaded once; LLMs with different adapters on one base share its batch "
        "and its weights. None: the base model.")
    tool_call_limit: int | None = Field(
        default=None, ge=1, description="Calls to each tool the conversation may hold "
        "answered before the tool is no longer offered where a grammar decides the reply "
        "(tools beside output_cls, or a required call); None = no limit.")
    output_cls: type[BaseModel] | None = Field(
        default=None, exclude=True,  # a class, not JSON: serialized LLMs leave it out
        description="Answers follow this pydantic class's JSON schema (a "
        "grammar): with tools, each reply is a tool call or that JSON. Give an agent the "
        "same class as its output_cls and its structured output costs no extra call.")
    keep_alive: float | None = Field(
        default=None, allow_inf_nan=False,
        description="Seconds the model stays loaded once the engine is idle after each "
        "request made here (0: unloaded right after; negative: kept loaded), as Ollama's; "
        "None = the engine's EngineConfig.keep_alive.")
    engine_config: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig fields for the shared engine; empty reuses any existing one.")

    _engine: Engine = PrivateAttr()
    _context_window: int | None = PrivateAttr(default=None)

    def __init__(self, model: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        """Validate the settings and attach to the model's shared engine (loaded lazily)."""
        super().__init__(model=None if model is None else os.fspath(model), **kwargs)
        self._sampling({})  # bad sampling values fail here, naming the field
        self._engine = get_engine(self.model, **self.engine_config)

    @classmethod
    def class_name(cls) -> str:
        """The name LlamaIndex serialisation records for this class."""
        return "MLXBatchLLM"

    @property
    def engine(self) -> Engine:
        """The process-wide engine this LLM (and every other adapter on its model) uses."""
        return self._engine

    @property
    def model_name(self) -> str:
        """The model as given, or the resolved default model's directory name."""
        return self.model if self.model is not None else self._engine.model_path.name

    @property
    def metadata(self) -> LLMMetadata:
        """LlamaIndex's view of the model; the first call loads it for its context window."""
        if self._context_window is None:
            limit = self._engine.start().stats().context_limit
            self._context_window = limit or DEFAULT_CONTEXT_WINDOW
        return LLMMetadata(context_window=self._context_window, num_output=self.max_tokens,
                           is_chat_model=True, is_function_calling_model=True,
                           model_name=self.model_name)

    # ----- building and submitting requests -------------------------------------------

    def _sampling(self, kwargs: Mapping[str, Any]) -> SamplingParams:
        """The fields' sampling settings with this call's overrides (validated)."""
        settings = call_sampling(self, kwargs, REQUEST_OPTIONS)
        constraint = kwargs.get("constraint")
        if constraint is None and self.output_cls is not None:
            constraint = json_kwargs(self.output_cls, None)["constraint"]
        return SamplingParams(**settings, constraint=constraint)

    def _request(self, prompt: str | tuple[Message, ...], kwargs: Mapping[str, Any]) -> _Request:
        """A submit-ready request; unknown per-call options raise instead of being dropped."""
        unknown = sorted(set(kwargs) - set(_PER_CALL))
        if unknown:
            raise TypeError(f"MLXBatchLLM got unexpected keyword arguments {unknown}; "
                            f"per-call options are {list(_PER_CALL)}")
        options: dict[str, Any] = {"timeout": kwargs.get("timeout", self.timeout)}
        if kwargs.get("tools"):  # converted once (tools from a tool turn were already)
            tools = kwargs["tools"]
            options["tools"] = tool_specs(tools if isinstance(tools, tuple)
                                          else _listed(tools, "tools"))
        for name in ("tool_choice", "parallel_tool_calls"):
            if kwargs.get(name) is not None:
                options[name] = kwargs[name]
        extra = kwargs.get("chat_template_kwargs") or {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"chat_template_kwargs must be a dict of template variables, got "
                            f"{type(extra).__name__}")
        template = {**self.chat_template_kwargs, **extra}
        if template:
            options["chat_template_kwargs"] = template
        params = self._sampling(kwargs)
        logprobs = RequestLogprobs(self._engine, params.logprobs)
        if isinstance(prompt, str):
            return _Request(_text_request(prompt, params, options), options["timeout"], logprobs)
        chat = ChatRequest.from_openai(
            prompt, params, tools=options.get("tools"), tool_choice=options.get("tool_choice"),
            parallel_tool_calls=options.get("parallel_tool_calls", True),
            chat_template_kwargs=options.get("chat_template_kwargs"))
        return _Request(chat, options["timeout"], logprobs)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]) -> _Request:
        """A request for chat messages (rendered by the model's chat template)."""
        return self._request(to_engine_messages(messages), kwargs)

    async def _achat_request(self, messages: Sequence[ChatMessage],
                             kwargs: Mapping[str, Any]) -> _Request:
        """``_chat_request`` for the async paths: a history with images is converted on a
        worker thread, where they are read and decoded, so the event loop never stalls."""
        if not carries_images(messages):
            return self._chat_request(messages, kwargs)
        return await anyio.to_thread.run_sync(partial(self._chat_request, messages, kwargs))

    def _completion_request(self, prompt: str, formatted: bool,
                            kwargs: Mapping[str, Any]) -> _Request:
        """A raw-text request; ``formatted=False`` applies ``completion_to_prompt`` first."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__} {prompt!r:.40}")
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return self._request(prompt, kwargs)

    def _submit(self, request: _Request) -> RequestHandle:
        """Queue the request on the shared engine; returns at once."""
        return self._engine.submit(request.request, timeout=request.timeout,
                                   **submit_options(self.keep_alive))

    # ----- chat and completion, sync ---------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """One assistant turn (answer, reasoning as a ThinkingBlock, tool calls as blocks)."""
        request = self._chat_request(messages, kwargs)
        completion = request.checked(_wait(self._submit(request)))
        return chat_response(completion, self.model_name, logprobs=request.logprobs(completion))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Continue raw text (no chat template)."""
        request = self._completion_request(prompt, formatted, kwargs)
        completion = _wait(self._submit(request))
        return completion_response(completion, self.model_name,
                                   logprobs=request.logprobs(completion))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Chunks with ``delta`` and the text so far; the request starts at first ``next``."""
        request = self._chat_request(messages, kwargs)
        chunks = StreamChunks(self.model_name, request.checked, request.openai_logprobs)
        return _chunks(lambda: self._submit(request), chunks.chat)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        """Completion chunks; the request starts at first ``next``."""
        request = self._completion_request(prompt, formatted, kwargs)
        chunks = StreamChunks(self.model_name, logprobs=request.openai_logprobs)
        return _chunks(lambda: self._submit(request), chunks.completion)

    # ----- chat and completion, async (native: the event loop never blocks) ------------

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Await one assistant turn; cancelling the awaiting task evicts the row."""
        request = await self._achat_request(messages, kwargs)
        completion = request.checked(await self._submit(request).aresult())
        return chat_response(completion, self.model_name, logprobs=request.logprobs(completion))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        """Await a raw-text continuation; cancelling the awaiting task evicts the row."""
        request = self._completion_request(prompt, formatted, kwargs)
        completion = await self._submit(request).aresult()
        return completion_response(completion, self.model_name,
                                   logprobs=request.logprobs(completion))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        """An async generator of chunks; the request starts at its first iteration."""
        request = await self._achat_request(messages, kwargs)
        chunks = StreamChunks(self.model_name, request.checked, request.openai_logprobs)
        return _achunks(lambda: self._submit(request), chunks.chat)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        """An async generator of completion chunks; the request starts at first iteration."""
        request = self._completion_request(prompt, formatted, kwargs)
        chunks = StreamChunks(self.model_name, logprobs=request.openai_logprobs)
        return _achunks(lambda: self._submit(request), chunks.completion)

    # ----- tools ----------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Chat keyword arguments for a tool turn; a required or named tool is grammar-forced."""
        messages = list(_listed(chat_history or [], "chat_history"))
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif isinstance(user_msg, ChatMessage):
            messages.append(user_msg)
        elif user_msg is not None:
            raise TypeError(f"user_msg must be a str or a ChatMessage, got "
                            f"{type(user_msg).__name__}")
        chat_kwargs: dict[str, Any] = {"messages": messages, **kwargs}
        if tools:
            chat_kwargs["tools"] = tool_specs(_listed(tools, "tools"))  # converted once
            chat_kwargs["parallel_tool_calls"] = allow_parallel_tool_calls
        if tool_choice is None and tool_required:
            tool_choice = "required"  # without tools the engine raises, naming the problem
        if tool_choice is not None:
            chat_kwargs["tool_choice"] = tool_choice
        return chat_kwargs

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[Any],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Keep only the first call when parallel calls were not allowed."""
        return response if allow_parallel_tool_calls else keep_first_call(response)

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        """The response's tool calls, each with its own ``tool_id``."""
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections

    # ----- structured output (grammar-constrained JSON) --------------------------------

    @dispatcher.span
    def structured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        """``output_cls`` filled by the model, its JSON forced to the class's schema."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(
            output_cls=output_cls, template=prompt, template_args=prompt_args))
        messages = self._get_messages(prompt, **prompt_args)
        result = self._answered(output_cls, messages)
        if result is None:
            response = self.chat(messages, **json_kwargs(output_cls, llm_kwargs))
            result = parse_structured(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(self, output_cls: type[Any], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        """Async ``structured_predict``; cancelling the awaiting task evicts the row."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs,
                                                     **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(
            output_cls=output_cls, template=prompt, template_args=prompt_args))
        messages = self._get_messages(prompt, **prompt_args)
        result = self._answered(output_cls, messages)
        if result is None:
            response = await self.achat(messages, **json_kwargs(output_cls, llm_kwargs))
            result = parse_structured(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    def _answered(self, output_cls: type[Any], messages: Sequence[ChatMessage]) -> Any:
        """An agent's answer already in ``output_cls``'s JSON (``self.output_cls`` made its
        replies so): the structured output, without asking the model again. None else."""
        if self.output_cls is None or output_cls is not self.output_cls:
            return None
        return transcript_answer(output_cls, messages)

    def _structured_stream_call(self, output_cls: type[Any], prompt: Any,
                                llm_kwargs: dict[str, Any] | None = None,
                                **prompt_args: Any) -> Any:
        """Partial objects as the constrained JSON streams in (base class adds the events)."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super()._structured_stream_call(output_cls, prompt, llm_kwargs, **prompt_args)
        messages = self._get_messages(prompt, **prompt_args)
        stream = self.stream_chat(messages, **json_kwargs(output_cls, llm_kwargs))
        step = PartialObjects(output_cls, self)
        return (step(response) for response in stream)

    async def _structured_astream_call(self, output_cls: type[Any], prompt: Any,
                                       llm_kwargs: dict[str, Any] | None = None,
                                       **prompt_args: Any) -> Any:
        """Async partial objects as the constrained JSON streams in."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super()._structured_astream_call(output_cls, prompt, llm_kwargs,
                                                          **prompt_args)
        messages = self._get_messages(prompt, **prompt_args)
        stream = await self.astream_chat(messages, **json_kwargs(output_cls, llm_kwargs))
        step = PartialObjects(output_cls, self)  # the sync stream's step, over async chunks
        return (step(response) async for response in stream)


_Chunk = TypeVar("_Chunk")


def _chunks(submit: Callable[[], RequestHandle],
            to_chunk: Callable[[StreamEvent], _Chunk | None]) -> Generator[_Chunk, None, None]:
    """Chunks of one request, submitted at the first ``next``; closing or dropping the
    generator evicts the row."""
    handle = submit()
    try:
        for event in handle:
            chunk = to_chunk(event)
            if chunk is not None:
                yield chunk
    finally:
        handle.cancel()


async def _achunks(
    submit: Callable[[], RequestHandle], to_chunk: Callable[[StreamEvent], _Chunk | None]
) -> AsyncGenerator[_Chunk, None]:
    """The async twin: task cancellation, aclose() or garbage collection evicts the row."""
    handle = submit()
    try:
        async for event in handle:
            chunk = to_chunk(event)
            if chunk is not None:
                yield chunk
    finally:
        handle.cancel()
