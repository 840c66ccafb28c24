"""A request prepared once, outside the step loop: prompt ids, tools, constraint, stops.

``RequestSpec`` is what ``Engine.submit`` validated on the caller's thread without a
tokenizer (tools normalised, tool choice resolved, schemas checked). ``Preparer`` turns
it into a ``PreparedRequest`` for this model's tokenizer: the prompt rendered and
encoded, the forced-call grammar built and compiled, the stop ids resolved. The loop
only ever sees prepared requests. No mlx here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.requests.channels import TOOL, ChannelSplitter, RowChannels
from engine.requests.constraints import Constraint, JsonSchema
from engine.requests.grammar import GrammarCompiler, validate_constraint
from engine.requests.prompts import PromptRenderer, checked_prompt
from engine.requests.request import Prompt, SamplingParams, check_template_options
from engine.requests.string_repeats import DEFAULT_NGRAM
from engine.requests.text import RowText
from engine.requests.tools import (
    ToolSpec,
    forced_call_grammar,
    forced_call_schema,
    normalize_tool_choice,
    normalize_tools,
)


@dataclass(frozen=True)
class RequestSpec:
    """A submitted request as validated at the door (no tokenizer needed)."""

    prompt: Prompt
    params: SamplingParams
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"  # "auto", "none", "required" or a tool name
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rendered_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the prompt shows: none when ``tool_choice`` is "none"."""
        return self.tools if self.tool_choice != "none" else ()

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice not in ("auto", "none")


@dataclass(frozen=True)
class PreparedRequest:
    """What the loop and the lanes need: ids, final sampling settings, stops, channels."""

    prompt_ids: list[int]
    params: SamplingParams  # with the forced-call grammar as its constraint, if any
    stop_ids: frozenset[int]
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none
    start_channel: str = "content"


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
                               encoded.start_channel)

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
        splitter = ChannelSplitter(self.prompts.channel_markers(), prepared.start_channel)
        return RowChannels(splitter, self.prompts.tool_parser, spec.tools,
                           spec.parallel_tool_calls)

    def _forced_call(self, spec: RequestSpec) -> Constraint:
        """The grammar that forces tool calls, with markers as this tokenizer spells them."""
        start, end = self.prompts.channel_markers()[TOOL]
        return forced_call_grammar(spec.tools, spec.tool_choice, spec.parallel_tool_calls,
                                   self.compiler.lark_literal(start),
                                   self.compiler.lark_literal(end))


def request_spec(
    prompt: Prompt,
    params: SamplingParams | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> RequestSpec:
    """Everything ``submit`` can check without a tokenizer, checked once, at the door."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    prompt = checked_prompt(prompt)  # a checked private copy (engine.requests.prompts)
    template_kwargs = check_template_options(parallel_tool_calls, chat_template_kwargs)
    specs = normalize_tools(tools)
    choice = normalize_tool_choice(tool_choice, specs)
    if specs and choice != "none" and not is_chat(prompt):
        raise ValueError("tools need a chat-messages prompt")
    spec = RequestSpec(prompt, params, specs, choice, parallel_tool_calls, template_kwargs)
    if spec.forces_call and params.constraint is not None:
        raise ValueError("a forced tool_choice cannot be combined with a constraint")
    if spec.forces_call:  # the call schema now; its grammar is built once, when prepared
        validate_constraint(JsonSchema(forced_call_schema(specs, choice)))
    elif params.constraint is not None:
        validate_constraint(params.constraint)
    return spec


def is_chat(prompt: Prompt | Sequence[Any]) -> bool:
    """Whether a prompt is a list of chat messages (dicts)."""
    return not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)
