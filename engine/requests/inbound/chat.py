"""A chat request as one typed value, converted once from OpenAI's wire shapes.

``ChatRequest`` is what every door hands the engine: checked messages, tool specs, the
tool choice, sampling settings (the output constraint among them) and template options.
``ChatRequest.from_openai`` is the only conversion from the wire shapes; ``Engine.submit``
takes the value as it is, so nothing downstream normalises it again. ``sampling_from_openai``
is the one reading of OpenAI's sampling parameter names. No mlx here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from engine.errors import InvalidRequestError
from engine.requests.inbound.messages import Message, messages_from_openai
from engine.requests.inbound.output_constraint import Constraint
from engine.requests.inbound.sampling import SamplingParams, Tools, check_template_options
from engine.requests.inbound.tool_specs import ToolSpec, normalize_tool_choice, normalize_tools

# The sampling settings a face exposes as fields and per-call overrides, by their
# ``SamplingParams`` names (``stop`` too): listed once, here, for every face.
# Every option a door passes to SamplingParams, by its SamplingParams name. A new option is
# a SamplingParams field, a name here and a field at each door; tests/adapters/
# test_request_options.py fails until every door passes it.
REQUEST_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "seed", "stop", "logprobs", "top_logprobs",
                   "reasoning_budget", "repeat_answered_calls", "tool_call_limit", "adapter")
SAMPLING_FIELDS = REQUEST_OPTIONS  # the name before the agent options joined


def sampling_from_options(options: Mapping[str, Any], **fixed: Any) -> SamplingParams:
    """``SamplingParams`` from a door's options by name, a None value leaving the default
    (``stop`` may be one string); ``fixed`` are the door's own (a constraint). Names that
    are not ``REQUEST_OPTIONS`` raise ``TypeError``."""
    unknown = sorted(set(options) - set(REQUEST_OPTIONS))
    if unknown:
        raise TypeError(f"not request options: {unknown}; they are {list(REQUEST_OPTIONS)}")
    values = {name: value for name, value in options.items() if value is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = (values["stop"],)
    return SamplingParams(**values, **fixed)


class ToolChoiceView:
    """What a request's tools and resolved tool choice mean, for every request type that
    carries them (``ChatRequest``)."""

    tools: tuple[ToolSpec, ...]
    tool_choice: str

    @property
    def rendered_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the prompt shows: none when ``tool_choice`` is "none"."""
        return self.tools if self.tool_choice != "none" else ()

    @property
    def forces_call(self) -> bool:
        """A tool choice other than auto/none: the engine's grammar forces the call."""
        return forces_call(self.tools, self.tool_choice)


@dataclass(frozen=True)
class ChatRequest(ToolChoiceView):
    """One chat request, checked: build it with ``from_openai`` (or from typed parts).

    ``tool_choice`` is resolved: "auto", "none", "required" or the name of one of
    ``tools``. Tools and an output constraint may come together (an agent's tools and its
    final schema): with "auto" the reply is a call or JSON the constraint accepts (one
    grammar for either, when the constraint is JSON); a forced choice makes it a call.
    """

    messages: tuple[Message, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Typed parts built by hand get the same checks as converted ones (cheap).
        if not self.messages or not all(isinstance(m, Message) for m in self.messages):
            raise InvalidRequestError("messages must be a non-empty tuple of Message values "
                                      "(ChatRequest.from_openai converts dicts)", "messages")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools))
        # An invariant, not a conversion: the choice was resolved when it was built.
        names = {t.name for t in self.tools}
        if self.tool_choice not in ("auto", "none", "required", *names) or (
                self.tool_choice == "required" and not self.tools):
            raise InvalidRequestError(f"tool_choice {self.tool_choice!r:.70} must be 'auto', "
                                      f"'none', 'required' (with tools) or one of the tools "
                                      f"{sorted(names)}", "tool_choice")
        object.__setattr__(self, "template_kwargs", check_template_options(
            self.parallel_tool_calls, self.template_kwargs))

    @classmethod
    def from_openai(
        cls,
        messages: Any,
        params: SamplingParams | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        root: str = "messages",
    ) -> ChatRequest:
        """THE conversion from OpenAI's shapes (messages, tools, tool_choice); raises
        naming the field (``root`` names the messages argument)."""
        # Specs converted already (a face's bound tools) are taken as they are.
        specs = (tuple(cast(Sequence[ToolSpec], tools)) if _are_specs(tools)
                 else normalize_tools(cast(Sequence[Mapping[str, Any]] | None, tools)))
        return cls(messages_from_openai(messages, root),
                   params if params is not None else SamplingParams(),
                   specs, normalize_tool_choice(tool_choice, specs),
                   parallel_tool_calls,
                   chat_template_kwargs if chat_template_kwargs is not None else {})


def forces_call(tools: Sequence[ToolSpec], tool_choice: str) -> bool:
    """Whether tools with this resolved choice force a call (the one definition)."""
    return bool(tools) and tool_choice not in ("auto", "none")


def _are_specs(tools: Any) -> bool:
    return isinstance(tools, tuple | list) and bool(tools) and all(
        isinstance(t, ToolSpec) for t in tools)


def sampling_from_openai(
    *,
    max_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    constraint: Constraint | None = None,
    default_temperature: float = 0.0,
) -> SamplingParams:
    """``SamplingParams`` from OpenAI's names (a None temperature takes the default)."""
    # top_logprobs without logprobs is refused by SamplingParams (naming top_logprobs).
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature if temperature is not None else default_temperature,
        top_p=top_p if top_p is not None else 1.0, seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=bool(logprobs), top_logprobs=top_logprobs or 0, constraint=constraint)
