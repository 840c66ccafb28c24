"""A request prepared once, outside the step loop: prompt ids, tools, constraint, stops.

``RequestSpec`` is what ``Engine.submit`` validated on the caller's thread without a
tokenizer: a ``ChatRequest`` taken as it is (the faces converted into it once), or raw
arguments converted through the same ``ChatRequest.from_openai``. ``Preparer`` turns
it into a ``PreparedRequest`` for this model's tokenizer: the prompt rendered and
encoded, the forced-call grammar built and compiled, the stop ids resolved. The loop
only ever sees prepared requests. No mlx here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError
from engine.requests.constraints.forced_calls import forced_call_grammar, forced_call_schema
from engine.requests.constraints.grammar import GrammarCompiler, validate_constraint
from engine.requests.constraints.string_repeats import DEFAULT_NGRAM
from engine.requests.inbound.chat import ChatRequest, ToolChoiceView
from engine.requests.inbound.output_constraint import Constraint, JsonSchema
from engine.requests.inbound.prompts import PromptRenderer, checked_prompt, is_chat
from engine.requests.inbound.sampling import Prompt, SamplingParams, Tools, check_template_options
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import CONTENT, REASONING, TOOL, ChannelSplitter
from engine.requests.outbound.markers import channel_markers, tool_parser
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText


@dataclass(frozen=True)
class RequestSpec(ToolChoiceView):
    """A submitted request as validated at the door (no tokenizer needed)."""

    prompt: Prompt
    params: SamplingParams
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"  # "auto", "none", "required" or a tool name
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    call_schema: dict[str, Any] | None = None  # the forced call's schema, built once

    @classmethod
    def of_chat(cls, chat: ChatRequest) -> RequestSpec:
        """A typed chat request as it is: nothing is converted again."""
        schema = forced_call_schema(chat.tools, chat.tool_choice) if chat.forces_call else None
        return cls(chat.messages, chat.params, chat.tools, chat.tool_choice,
                   chat.parallel_tool_calls, chat.template_kwargs, schema)


@dataclass(frozen=True)
class PreparedRequest:
    """What the loop and the lanes need: ids, final sampling settings, stops, channels."""

    prompt_ids: list[int]
    params: SamplingParams  # with the forced-call grammar as its constraint, if any
    stop_ids: frozenset[int]
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none
    start_channel: str = CONTENT


class Preparer:
    """Prepares requests for one tokenizer; lives on the engine thread."""

    def __init__(self, tokenizer: Any, model_path: Path, vocab_size: int,
                 json_string_ngram: int = DEFAULT_NGRAM) -> None:
        self.tokenizer = tokenizer
        self.prompts = PromptRenderer(tokenizer, model_path, vocab_size)
        self.compiler = GrammarCompiler(tokenizer._tokenizer, vocab_size,
                                        string_ngram=json_string_ngram)

    def prepare(self, spec: RequestSpec) -> PreparedRequest:
        """Render, encode and compile; raises the request's own error if it cannot run."""
        spec.params.check_vocabulary(self.prompts.vocab_size)
        tools = spec.rendered_tools
        encoded = self.prompts.encode_request(spec.prompt, tools, dict(spec.template_kwargs))
        params = spec.params
        if spec.forces_call:
            params = replace(params, constraint=self._forced_call(spec))
        if params.constraint is not None:
            self.compiler.compile(params.constraint)  # cached: the lane's matcher reuses it
        return PreparedRequest(encoded.ids, params, self.stop_ids(params), encoded.head_len,
                               REASONING if encoded.opens_reasoning else CONTENT)

    def count_tokens(self, spec: RequestSpec) -> int:
        encoded = self.prompts.encode_request(spec.prompt, spec.rendered_tools,
                                              dict(spec.template_kwargs))
        return len(encoded.ids)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        return eos | frozenset(params.stop_token_ids)

    def row_text(self, params: SamplingParams) -> RowText:
        return RowText(self.tokenizer.detokenizer, params.stop)

    def row_channels(self, spec: RequestSpec, prepared: PreparedRequest) -> RowChannels:
        splitter = ChannelSplitter(channel_markers(self.tokenizer), prepared.start_channel)
        return RowChannels(splitter, tool_parser(self.tokenizer), spec.tools,
                           spec.parallel_tool_calls)

    def _forced_call(self, spec: RequestSpec) -> Constraint:
        """The grammar that forces tool calls, with markers as this tokenizer spells them."""
        start, end = channel_markers(self.tokenizer)[TOOL]
        return forced_call_grammar(spec.tools, spec.tool_choice, spec.parallel_tool_calls,
                                   self.compiler.lark_literal(start),
                                   self.compiler.lark_literal(end), schema=spec.call_schema)


def request_spec(
    prompt: Prompt | ChatRequest,
    params: SamplingParams | None,
    tools: Tools | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> RequestSpec:
    """Everything ``submit`` can check without a tokenizer, checked once, at the door.

    A ``ChatRequest`` was checked when it was built and is taken as it is; raw chat
    messages go through ``ChatRequest.from_openai`` (the one rulebook) here.
    """
    if isinstance(prompt, ChatRequest):
        if params is not None or tools or tool_choice is not None or chat_template_kwargs:
            raise TypeError("a ChatRequest carries its own params, tools, tool_choice and "
                            "template options: pass them when building it, not to submit")
        spec = RequestSpec.of_chat(prompt)
    else:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        checked = checked_prompt(prompt)  # a checked private copy (engine.requests.inbound.prompts)
        if is_chat(checked):
            spec = RequestSpec.of_chat(ChatRequest.from_openai(
                checked, params, tools=tools, tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                chat_template_kwargs=chat_template_kwargs, root="prompt"))
        else:
            template_kwargs = check_template_options(parallel_tool_calls, chat_template_kwargs)
            plain = ChatRequest.from_openai([{"role": "user", "content": ""}], params,
                                            tools=tools, tool_choice=tool_choice)
            if plain.tools and plain.tool_choice != "none":
                raise InvalidRequestError("tools need a chat-messages prompt", "tools")
            spec = RequestSpec(checked, params, plain.tools, plain.tool_choice,
                               parallel_tool_calls, template_kwargs)
    if spec.call_schema is not None:  # the call schema now; its grammar is built when prepared
        _validated(JsonSchema(spec.call_schema))
    elif spec.params.constraint is not None:
        _validated(spec.params.constraint)
    return spec


@lru_cache(maxsize=256)
def _validated(constraint: Constraint) -> None:
    """``validate_constraint``, once per distinct schema or grammar (a refusal is not cached:
    it raises again, cheaply, for the next request that sends it)."""
    validate_constraint(constraint)
