"""What a caller asks for besides messages: sampling settings and the door's own checks.

``SamplingParams`` is validated on construction; ``check_callbacks`` and
``check_template_options`` check ``submit``'s other arguments on the caller's thread.
Pure data: no mlx import, so the scheduler and streams can be tested without a model.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.requests.inbound.messages import Message
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
)
from engine.requests.inbound.tool_specs import ToolSpec

ChatMessage = dict[str, Any]


# Text, token ids, or chat messages: OpenAI dicts, or the rulebook's typed Message values.
Prompt = str | Sequence[int] | Sequence[ChatMessage] | Sequence[Message]


# Tools in OpenAI's function format, or the engine's specs (converted already).
Tools = Sequence[Mapping[str, Any]] | Sequence[ToolSpec]


# (token ids so far, logits [1, vocab]) -> logits; the mlx-lm logits-processor signature.
LogitsProcessor = Callable[[Any, Any], Any]


# Called on the engine thread per token; returning False stops the row.
TokenCallback = Callable[[int, str], bool | None]


def _check(condition: bool, name: str, message: str) -> None:
    # InvalidRequestError is a ValueError: the rulebook's refusal, naming the field.
    if not condition:
        raise InvalidRequestError(f"SamplingParams.{name} {message}", name)


def _as_tuple(value: Any, name: str, item_type: type) -> tuple[Any, ...]:
    if isinstance(value, item_type):
        return (value,)
    if value is None:
        return ()
    # bytes iterate as ints, strings as characters, mappings as keys: none is a list.
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"SamplingParams.{name} must be a {item_type.__name__} or a "
                                  f"list of them, got {type(value).__name__} {value!r:.40}", name)
    items = tuple(value)
    for item in items:
        _check(
            isinstance(item, item_type) and not isinstance(item, bool),
            name,
            f"must hold {item_type.__name__} values, got {item!r}",
        )
    return items


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated on construction.

    ``temperature == 0`` is greedy. ``ignore_eos`` keeps generating past the model's
    end-of-sequence token (benchmarks). ``stop`` strings are matched on the decoded text
    across token boundaries and are never streamed. ``seed`` (with temperature > 0)
    makes sampling reproducible; such requests run on the engine's serial lane.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)
    constraint: Constraint | None = None
    # Reasoning tokens a prompt that opens a reasoning block may spend before the grammar
    # closes it; then the constraint (if any) applies to the answer. None: unbounded.
    reasoning_budget: int | None = None
    # With tools ("auto") beside a JSON answer, the grammar refuses a call that repeats one
    # the history already answered (same tool, equal arguments, a tool result for it), so
    # the model calls something else or answers. True admits such repeats again.
    repeat_answered_calls: bool = False
    # Calls to each tool the history may hold answered before that tool is no longer
    # offered where a grammar decides the reply (tools beside a JSON answer, or a required
    # call): an agent on a small model that keeps calling then answers. None: no limit.
    tool_call_limit: int | None = None
    # A LoRA adapter for this request: a directory in mlx-lm's format (adapter_config.json,
    # adapters.safetensors), loaded on first use; rows with different adapters share one
    # batch over the base weights. None: the base model.
    adapter: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int)
        )
        object.__setattr__(self, "logits_processors", _processors(self.logits_processors))
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens < _INT32, "max_tokens",
               f"must be an integer in [1, 2**31), got {self.max_tokens!r}")
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and 0 <= self.top_k < _INT32, "top_k",
               f"must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p < 1, "min_p",
               f"must be in [0, 1), got {self.min_p!r}")
        _check(self.repetition_penalty is None
               or (_is_real(self.repetition_penalty) and self.repetition_penalty > 0),
               "repetition_penalty", f"must be None or > 0, got {self.repetition_penalty!r}")
        # mlx indexes with 32-bit ints: a larger window failed inside the row (bad_cast).
        _check(_is_int(self.repetition_context_size)
               and 1 <= self.repetition_context_size < _INT32, "repetition_context_size",
               f"must be an integer in [1, 2**31), got {self.repetition_context_size!r}")
        # mlx's PRNG key takes an unsigned 64-bit seed; anything else killed the engine thread.
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64), "seed",
               f"must be None or an integer in [0, 2**64), got {self.seed!r}")
        _check(self.reasoning_budget is None or (_is_int(self.reasoning_budget)
                                                 and 0 <= self.reasoning_budget < _INT32),
               "reasoning_budget",
               f"must be None or an integer in [0, 2**31), got {self.reasoning_budget!r}")
        _check(isinstance(self.repeat_answered_calls, bool), "repeat_answered_calls",
               f"must be a bool, got {self.repeat_answered_calls!r}")
        _check(self.tool_call_limit is None or (_is_int(self.tool_call_limit)
                                                and 1 <= self.tool_call_limit < _INT32),
               "tool_call_limit",
               f"must be None or an integer in [1, 2**31), got {self.tool_call_limit!r}")
        _check(self.adapter is None or (isinstance(self.adapter, str) and bool(self.adapter)),
               "adapter", f"must be None or an adapter directory (a non-empty str), got "
               f"{self.adapter!r:.60}")
        _check(all(self.stop), "stop", "must not contain empty strings")
        _check(all(0 <= t < _INT32 for t in self.stop_token_ids), "stop_token_ids",
               f"must be token ids in [0, 2**31), got {self.stop_token_ids!r:.60}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos",
               f"must be a bool, got {self.ignore_eos!r}")
        _check(isinstance(self.logprobs, bool), "logprobs",
               f"must be a bool, got {self.logprobs!r}")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               "top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
               f"{self.top_logprobs!r}")
        # OpenAI's rule: alternatives come with the chosen tokens' logprobs, never alone
        # (asked alone, they would be computed and then dropped without a word).
        _check(self.logprobs or not self.top_logprobs, "top_logprobs",
               f"needs logprobs=True (got top_logprobs={self.top_logprobs} without it)")
        _check(all(callable(p) for p in self.logits_processors), "logits_processors",
               "must be callables (tokens, logits) -> logits")
        # mlx gets floats: an int such as 2**64 failed the batch step with every row in it.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        _check(self.constraint is None
               or isinstance(self.constraint, JsonSchema | JsonObject | Regex | LarkGrammar),
               "constraint", f"must be a JsonSchema, JsonObject, Regex or LarkGrammar, "
               f"got {self.constraint!r}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids and a ``top_k`` this model's vocabulary cannot mean.

        Called when the request is prepared for a model: ``top_k`` past the vocabulary
        failed mlx-lm's sampler inside the batch step (every row in flight with it), and a
        stop id past it can never be generated.
        """
        _check(self.top_k < vocab_size, "top_k",
               f"must be below the model's vocabulary size {vocab_size} (0 = off), "
               f"got {self.top_k}")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, "stop_token_ids",
               f"out of range [0, {vocab_size}) of the model's vocabulary: {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_serial_lane(self) -> bool:
        """A seeded random request runs alone so its output depends only on its seed."""
        return self.seed is not None and not self.greedy


MAX_TOP_LOGPROBS = 20  # OpenAI's limit, so a request valid here is valid there too
_INT32 = 2**31  # mlx indexes and compares token ids and counts as 32-bit integers


def _processors(value: Any) -> tuple[LogitsProcessor, ...]:
    if value is None:
        return ()
    if callable(value):
        return (value,)
    _check(isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)),
           "logits_processors", f"must be a list of callables (tokens, logits) -> logits, "
           f"got {type(value).__name__}")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    if _is_int(value):  # an int too large for a float overflows on its way to mlx
        return bool(abs(value) <= sys.float_info.max)
    return isinstance(value, float) and math.isfinite(value)


# Keyword arguments of ``apply_chat_template`` that the engine sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "tokenize",
                                       "add_generation_prompt", "return_dict"})


def check_callbacks(on_token: Any, timeout: Any) -> None:
    """``submit``'s ``on_token`` and ``timeout``, checked at the door (caller's thread)."""
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be None or a callable (token_id, text) -> bool | None, "
                        f"got {type(on_token).__name__}")
    if timeout is None:
        return
    if not _is_real(timeout) and not isinstance(timeout, float):
        raise TypeError(f"timeout must be None or a number of seconds, got "
                        f"{type(timeout).__name__} {timeout!r:.40}")
    # inf would reach the engine thread's queue wait, which refuses it (OverflowError).
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0 (None for no "
                         f"timeout), got {timeout!r}")


def check_template_options(parallel_tool_calls: Any,
                           chat_template_kwargs: Any) -> dict[str, Any]:
    """``parallel_tool_calls`` must be a bool; ``chat_template_kwargs`` a mapping of names
    to values, without the arguments the engine passes to the template itself. Returns a
    copy of the kwargs, so a caller changing its dict later changes nothing queued."""
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be a bool, got "
                        f"{type(parallel_tool_calls).__name__} {parallel_tool_calls!r:.40}")
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict of template variables, got "
                        f"{type(chat_template_kwargs).__name__} {chat_template_kwargs!r:.40}")
    names = [k for k in chat_template_kwargs if not (isinstance(k, str) and k.isidentifier())]
    if names:
        raise ValueError(f"chat_template_kwargs keys must be identifiers (template variable "
                         f"names), got {names[:3]!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs must not set {reserved}: the engine passes "
                         "them (tools go in submit's tools=)")
    return dict(chat_template_kwargs)
