"""The engine's results as LangChain's outputs (pure, no model): completions and stream
events -> ``AIMessage`` / ``AIMessageChunk`` with usage, response metadata, reasoning,
tool calls and their streamed chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
)
from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk
from langchain_core.utils.json import parse_partial_json

from engine import (
    Completion,
    FinishReason,
    StreamEvent,
    ToolCallDelta,
    Usage,
)
from mlx_providers._langchain_inbound import PROVIDER, REASONING_KEY

# ----- results out -------------------------------------------------------------------------


def usage_metadata(usage: Usage) -> UsageMetadata:
    """Engine usage, renamed for LangChain (cache hits as ``input_token_details.cache_read``,
    tokens spent reasoning as ``output_token_details.reasoning``)."""
    counts = usage.as_dict()
    # ``output_token_details`` is ``NotRequired`` upstream, but langchain-core 1.x spells it
    # ``typing.NotRequired`` (3.11+), which mypy cannot resolve at python_version = 3.10 and so
    # treats as a required ``Any`` key. ``unused-ignore``: under 3.11, or a langchain-core that
    # takes ``NotRequired`` from typing_extensions, there is nothing to ignore.
    metadata: UsageMetadata = {  # type: ignore[typeddict-item, unused-ignore]
        "input_tokens": counts["prompt_tokens"],
        "output_tokens": counts["completion_tokens"],
        "total_tokens": counts["total_tokens"],
        "input_token_details": InputTokenDetails(cache_read=counts["cached_tokens"]),
        "output_token_details": OutputTokenDetails(reasoning=counts["reasoning_tokens"]),
    }
    return metadata


# langchain-core (1.8.4+) reads ``normalized_finish_reason`` beside the provider's raw one,
# in its own vocabulary ("tool_call", singular; it corrects "stop" with calls itself).
NORMALIZED = {FinishReason.STOP: "stop", FinishReason.TOOL_CALLS: "tool_call",
              FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled",
              FinishReason.ERROR: "error"}


# OpenAI's ``logprobs`` object (``engine.openai_logprobs``) or None: where ChatOpenAI puts
# it, ``response_metadata["logprobs"]`` (and ``generation_info``, which LangChain copies
# there). A streamed chunk carries its own tokens': LangChain concatenates the lists when
# chunks are added, so a merged stream's equal the whole answer's.
Logprobs = dict[str, Any] | None


def response_metadata(completion: Completion, model_name: str,
                      logprobs: Logprobs = None) -> dict[str, Any]:
    """What LangChain callbacks and tracers read: model, provider, finish reason, timings,
    and the logprobs when they were asked for."""
    meta: dict[str, Any] = {"model_name": model_name, "model_provider": PROVIDER,
                            "finish_reason": completion.finish_reason.value,
                            "normalized_finish_reason": NORMALIZED[completion.finish_reason]}
    if logprobs is not None:
        meta["logprobs"] = logprobs
    if completion.truncated is not None:  # the engine's word: max_tokens cut what had to be whole
        meta["truncated"] = completion.truncated
    if completion.usage.time_to_first_token is not None:
        meta["time_to_first_token"] = completion.usage.time_to_first_token
    if completion.usage.decode_tokens_per_second is not None:
        meta["decode_tokens_per_second"] = completion.usage.decode_tokens_per_second
    return meta


def _reasoning_kwargs(reasoning: str | None) -> dict[str, Any]:
    return {REASONING_KEY: reasoning} if reasoning else {}


def ai_message(completion: Completion, model_name: str, logprobs: Logprobs = None) -> AIMessage:
    """A finished request as an ``AIMessage`` with parsed and invalid tool calls."""
    return AIMessage(
        content=completion.content,
        additional_kwargs=_reasoning_kwargs(completion.reasoning),
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id)
                    for c in completion.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.raw, id=c.id, error=c.error)
                            for c in completion.invalid_tool_calls],
        usage_metadata=usage_metadata(completion.usage),
        response_metadata=response_metadata(completion, model_name, logprobs),
    )


def _generation_info(finish_reason: FinishReason | None, logprobs: Logprobs) -> dict[str, Any]:
    info: dict[str, Any] = {} if finish_reason is None else {"finish_reason": finish_reason.value}
    if logprobs is not None:
        info["logprobs"] = logprobs
    return info


def chat_generation(completion: Completion, model_name: str,
                    logprobs: Logprobs = None) -> ChatGeneration:
    return ChatGeneration(message=ai_message(completion, model_name, logprobs),
                          generation_info=_generation_info(completion.finish_reason, logprobs))


def _invalid_args(raw: str) -> str:
    # A chunk whose args parse to a dict becomes a valid call when chunks merge, so
    # markup that parses (e.g. cut off mid-object) is passed on quoted instead.
    try:
        parses = isinstance(parse_partial_json(raw), dict)
    except Exception:
        parses = False
    return json.dumps(raw) if parses else raw


def call_delta_chunks(deltas: Sequence[ToolCallDelta]) -> list[Any]:
    """The engine's tool-call deltas as ``tool_call_chunks``: LangChain merges them by
    ``index`` (id and name from the first, ``args`` fragments concatenated). The engine
    holds back a call it may still drop, so a merged stream never shows a call ``invoke``
    would drop; a call cut by the row's end was sent as far as it was written (as with
    ChatOpenAI), which ``invoke`` lists in ``invalid_tool_calls``."""
    merged: list[ToolCallDelta] = []  # one chunk per call and step: LangChain merges
    for d in deltas:                  # same-index entries across chunks, not within one
        last = merged[-1] if merged else None
        if last is not None and last.index == d.index and d.id is None:
            merged[-1] = ToolCallDelta(d.index, last.id, last.name, last.arguments + d.arguments)
        else:
            merged.append(d)
    return [tool_call_chunk(name=d.name, args=d.arguments, id=d.id, index=d.index)
            for d in merged]


def invalid_call_chunks(completion: Completion) -> list[Any]:
    """The completion's unparsed calls that were never streamed, after every streamed
    call, for the last chunk (a streamed one's pieces went out already)."""
    unsent = [c for c in completion.invalid_tool_calls if c.index is None]
    offset = len(completion.tool_calls) + len(completion.invalid_tool_calls) - len(unsent)
    return [tool_call_chunk(name=c.name, args=_invalid_args(c.raw), id=c.id, index=offset + i)
            for i, c in enumerate(unsent)]


def event_chunk(event: StreamEvent, model_name: str,
                logprobs: Logprobs = None) -> ChatGenerationChunk | None:
    """One engine event as a chunk; None for a step that added nothing to show.

    Tool calls arrive as the engine keeps them; usage, invalid calls and response metadata
    ride on the last chunk only, so that adding chunks together counts tokens once.
    ``logprobs`` are the event's own tokens' (a token whose text is held back, or is
    tool-call markup, still brings its logprob: the chunk then has no content).
    """
    completion = event.completion
    calls = call_delta_chunks(event.tool_call_deltas)
    if completion is None:
        has_logprobs = bool(logprobs and logprobs["content"])
        if not event.content and not event.reasoning and not calls and not has_logprobs:
            return None
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=event.content, additional_kwargs=_reasoning_kwargs(event.reasoning),
                tool_call_chunks=calls,
                response_metadata={"logprobs": logprobs} if has_logprobs else {}),
            generation_info=_generation_info(None, logprobs) if has_logprobs else None)
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content=event.content,
            additional_kwargs=_reasoning_kwargs(event.reasoning),
            tool_call_chunks=calls + invalid_call_chunks(completion),
            usage_metadata=usage_metadata(completion.usage),
            response_metadata=response_metadata(completion, model_name, logprobs),
            chunk_position="last",
        ),
        generation_info=_generation_info(completion.finish_reason, logprobs),
    )


