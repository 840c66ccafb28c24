"""Legacy completions output: a whole ``text_completion``, or its streamed chunks.

A choice's text is the model's raw text (no channels: a completion continues text, it has
no reasoning or tool calls to split out), after the echoed prompt when ``echo`` asks for
it; ``finish_reason`` is ``stop`` or ``length``, the only two the legacy API has. A stream
sends each row's text as it is generated, in chunks naming their choice's ``index`` (the
rows of a request run together, so their chunks interleave), the echoed prompts first,
each choice's last chunk with its ``finish_reason``, then, with
``stream_options.include_usage``, one chunk with no choices and the usage of every row,
then ``[DONE]``. ``CompletionsAnswer`` is this endpoint's side of the shared generation flow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import FinishReason, StreamEvent, TokenText, Usage
from mlx_providers.server.chat_completions import data, new_id, usage_dict
from mlx_providers.server.errors import from_engine
from mlx_providers.server.legacy_logprobs import LegacyLogprobs


def legacy_finish_reason(reason: FinishReason) -> str:
    """``length`` when max_tokens cut it, else ``stop`` (a stop string or token, or EOS)."""
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass
class _Choice:
    """One row's output so far."""

    echo: str
    logprobs: LegacyLogprobs | None
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)


class CompletionsAnswer:
    """Builds one request's ``text_completion`` objects from its rows' engine events."""

    def __init__(self, model: str, token_text: TokenText, echoes: Sequence[str], *,
                 logprobs: bool = False, include_usage: bool = False) -> None:
        self.id = new_id("cmpl-")
        self.created = int(time.time())
        self.model = model
        self._include_usage = include_usage
        self._choices = [
            _Choice(echo, LegacyLogprobs(token_text, offset=len(echo)) if logprobs else None)
            for echo in echoes]

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> str:
        out = self._object([{"text": text, "index": index, "logprobs": logprobs,
                             "finish_reason": finish_reason}])
        if self._include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the usage one
        return data(out)

    def start(self) -> list[str]:
        """Each echoed prompt, before any generated text."""
        return [self._chunk(i, c.echo) for i, c in enumerate(self._choices) if c.echo]

    def feed(self, index: int, event: StreamEvent) -> list[str]:
        """The chunk one row's event becomes (none when it adds nothing)."""
        choice = self._choices[index]
        choice.text += event.text
        logprobs = (choice.logprobs.take(event.logprobs)
                    if choice.logprobs is not None and event.logprobs else None)
        if event.is_final:
            assert event.finish_reason is not None and event.usage is not None
            choice.finish_reason = legacy_finish_reason(event.finish_reason)
            choice.usage = event.usage
        elif not (event.text or logprobs):
            return []
        return [self._chunk(index, event.text, logprobs, choice.finish_reason)]

    def fail(self, error: BaseException) -> list[str]:
        return [data(from_engine(error, prompt_param="prompt").body())]

    def end(self) -> list[str]:
        """The usage chunk (when asked for), then the end."""
        usage = [data({**self._object([]), "usage": self._usage()})] if (
            self._include_usage) else []
        return [*usage, "[DONE]"]

    def body(self) -> dict[str, Any]:
        """The whole ``text_completion`` once every row's events were fed."""
        choices = [{"text": c.echo + c.text, "index": i,
                    "logprobs": c.logprobs.whole() if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(self._choices)]
        return {**self._object(choices), "usage": self._usage()}

    def close(self, outcome: str) -> None:
        """Nothing to keep: completions are not stored."""

    def _usage(self) -> dict[str, Any]:
        """Every row's usage added up (a prompt run ``n`` times counts ``n`` times; the
        prefix cache's share shows in ``cached_tokens``)."""
        rows = [c.usage for c in self._choices]
        return usage_dict(Usage(
            prompt_tokens=sum(u.prompt_tokens for u in rows),
            completion_tokens=sum(u.completion_tokens for u in rows),
            cached_tokens=sum(u.cached_tokens for u in rows),
            reasoning_tokens=sum(u.reasoning_tokens for u in rows)))
