"""A scripted stand-in for ``engine.Engine``: adapter plumbing tested without a model.

``ScriptedEngine`` implements the part of ``Engine``'s public API the faces use (``submit``
returning a real ``RequestHandle``, ``count_tokens``, ``tokenizer``, ``stats``, ``start``,
``model_path``, ``context_limit``, ``usable``/``serves_chat``, ``close``). Each submit is
checked as the engine checks it (``checked_request``: a forced call or constraint that
cannot compile raises at once, the same errors), recorded in ``calls``, and answered from its
``Reply``: one event per piece of content, then the final event with the completion, all
published before ``submit`` returns (the handle's stream buffers them, so sync, asyncio
and trio consumers read them as they would an engine's). A ``held`` reply never ends by
itself: like a long row, it ends when its handle is cancelled (``calls[i].cancelled``).

Put one behind the adapters with ``engine.registry.shared_engine(name, fake)``: every
``ChatMLXBatch(model=name)`` / ``MLXBatchLLM(model=name)`` then talks to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine import (
    ChatRequest,
    Completion,
    EngineConfig,
    EngineStats,
    FinishReason,
    InvalidToolCall,
    Request,
    RequestHandle,
    SamplingParams,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from engine.core.streams import RequestStream
from engine.registry import shared_engine
from engine.requests.inbound.sampling import check_callbacks
from engine.requests.prepare import checked_request


@dataclass(frozen=True)
class Reply:
    """What a scripted request answers: content in ``pieces`` (one event each)."""

    pieces: Sequence[str] = ("Hello", " from", " the", " script.")
    finish_reason: FinishReason = FinishReason.STOP
    tool_calls: tuple[ToolCall, ...] = ()
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    reasoning: str | None = None
    error: BaseException | None = None  # the request fails with this (final event's error)
    prompt_tokens: int = 7
    cached_tokens: int = 0
    held: bool = False  # publish the pieces, then end only when cancelled (a long row)


@dataclass
class Submitted:
    """One ``submit`` as the scripted engine received it: the request and its parts."""

    prompt: Request
    params: SamplingParams
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    chat_template_kwargs: Mapping[str, Any] | None
    timeout: float | None
    handle: RequestHandle | None = None
    cancelled: bool = False


class WordTokenizer:
    """One token per whitespace-separated word (what ``get_num_tokens`` counts with)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("w" * i for i in ids)


@dataclass(eq=False)  # compared and hashed by identity, as an engine is
class ScriptedEngine:
    """Answers every submit from ``reply`` (a ``Reply``, or a function of the call)."""

    reply: Reply | Callable[[Submitted], Reply] = field(default_factory=Reply)
    model_path: Path = Path("/scripted/fake-model")
    context_limit: int | None = 2048
    config: EngineConfig = field(default_factory=EngineConfig)
    calls: list[Submitted] = field(default_factory=list)
    usable: bool = True
    serves_chat: bool = True
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def start(self, timeout: float | None = None) -> ScriptedEngine:
        return self

    def stats(self) -> EngineStats:
        finished = [c for c in self.calls if not c.cancelled]
        return EngineStats(loaded=True, context_limit=self.context_limit,
                           completed=len(finished), cancelled=len(self.calls) - len(finished))

    def count_tokens(self, request: Request) -> int:
        checked = checked_request(request)
        if not isinstance(checked, ChatRequest):
            return len(str(checked.prompt).split())
        return sum(len(m.content.split()) + 3 for m in checked.messages)

    def close(self, timeout: float | None = 30.0) -> None:
        self.usable = False

    def submit(self, request: Request, *, on_token: Callable[[int, str], object] | None = None,
               timeout: float | None = None) -> RequestHandle:
        check_callbacks(on_token, timeout)
        checked = checked_request(request)  # raises what the engine raises
        tools: list[dict[str, Any]] | None = None
        tool_choice, parallel, template = None, True, None
        if isinstance(checked, ChatRequest):  # recorded as the engine reads them
            tools = [tool.as_openai() for tool in checked.tools] or None
            tool_choice, parallel = checked.tool_choice, checked.parallel_tool_calls
            template = dict(checked.template_kwargs) or None
        call = Submitted(checked, checked.params, tools, tool_choice, parallel, template,
                         timeout)
        self.calls.append(call)
        reply = self.reply(call) if callable(self.reply) else self.reply
        stream = RequestStream()

        ids: list[int] = []
        usage = Usage(prompt_tokens=reply.prompt_tokens, cached_tokens=reply.cached_tokens,
                      time_to_first_token=0.01, decode_tokens_per_second=100.0)

        def end(reason: FinishReason, error: BaseException | None) -> None:
            text = "".join(reply.pieces)
            final = replace(usage, completion_tokens=len(ids))
            completion = Completion(text, tuple(ids), reason, final, content=text,
                                    reasoning=reply.reasoning, tool_calls=reply.tool_calls,
                                    invalid_tool_calls=reply.invalid_tool_calls)
            # The calls stream as a real engine's do: a first delta (id, name), then the
            # arguments; a cancelled row sends none.
            deltas = () if reason is FinishReason.CANCELLED else tuple(
                d for i, c in enumerate(reply.tool_calls) for d in (
                    ToolCallDelta(i, c.id, c.name, ""),
                    ToolCallDelta(i, arguments=c.arguments_text)))
            stream.publish(StreamEvent("", (), None, reason, final, error,
                                       completion=completion, tool_call_deltas=deltas),
                           completion)

        def cancel() -> None:
            if not call.cancelled:
                call.cancelled = True
                end(FinishReason.CANCELLED, None)

        call.handle = RequestHandle(next(self._ids), stream, cancel)
        for i, piece in enumerate(reply.pieces):
            ids.append(i + 1)
            if on_token is not None:
                on_token(i + 1, piece)
            stream.publish(StreamEvent(piece, (i + 1,), content=piece))
        if not reply.held:
            end(FinishReason.ERROR if reply.error is not None else reply.finish_reason,
                reply.error)
        return call.handle


@contextmanager
def scripted(name: str = "scripted-model", reply: Reply | Callable[[Submitted], Reply] = Reply(),
             **options: Any) -> Iterator[ScriptedEngine]:
    """A ``ScriptedEngine`` shared as the engine for model ``name`` while inside."""
    fake = ScriptedEngine(reply, model_path=Path("/scripted") / name, **options)
    with shared_engine(name, fake):  # type: ignore[arg-type]
        yield fake
