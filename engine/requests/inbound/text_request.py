"""A prompt the model continues as it is (text or token ids), and the one request value.

``Engine.submit`` takes a ``Request``: a ``ChatRequest`` (messages rendered with the chat
template, tools, a tool choice) or a ``TextRequest`` (no template). Both are checked when
built, on the caller's thread, so nothing downstream converts them again. No mlx here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.messages import Message
from engine.requests.inbound.sampling import SamplingParams

_MAX_TOKEN_ID = 2**31 - 1  # mlx holds token ids as 32-bit integers


@dataclass(frozen=True)
class TextRequest:
    """Text or token ids continued as they are (no chat template), with sampling settings.

    ``prompt`` is kept as a private copy: text, or a tuple of token ids (integers, numpy's
    too, never bools or floats, in [0, 2**31); whether they are inside this model's
    vocabulary is checked when the request is prepared).
    """

    prompt: str | tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", checked_text_prompt(self.prompt))
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")


# What every door hands the engine.
Request = ChatRequest | TextRequest


def checked_text_prompt(prompt: Any) -> str | tuple[int, ...]:
    """A text request's prompt, checked, as a private copy (see ``TextRequest``)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        return prompt
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Iterable):
        hint = (" (one message? chat messages go in ChatRequest.from_openai(messages, ...))"
                if isinstance(prompt, Mapping) else "")
        raise TypeError(f"prompt must be text or a list of token ids, got "
                        f"{type(prompt).__name__}{hint}")
    items = list(prompt)
    if not items:
        raise ValueError("prompt is empty: give at least one token")
    if isinstance(items[0], Mapping | Message):
        raise TypeError("chat messages go in a ChatRequest: "
                        "ChatRequest.from_openai(messages, params, tools=...)")
    return tuple(_token_id(t, i) for i, t in enumerate(items))


def _token_id(value: Any, i: int) -> int:
    if isinstance(value, Mapping | Message):
        raise TypeError(f"prompt[{i}] is a dict after token ids: a prompt is text or token "
                        "ids, not a mix")
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"prompt[{i}] must be an integer token id, got "
                        f"{type(value).__name__} {value!r:.40}")
    token = operator.index(value)
    if not 0 <= token <= _MAX_TOKEN_ID:
        raise ValueError(f"prompt token ids out of range [0, 2**31): prompt[{i}] = {token}")
    return token
