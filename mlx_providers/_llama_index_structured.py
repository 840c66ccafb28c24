"""Structured output for ``structured_predict`` and its streams: the options that force JSON
valid against a pydantic class, the class parsed from the answer, and a cut answer raised as
``OutputTruncatedError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.bridge.pydantic import BaseModel

from engine import JsonSchema, OutputTruncatedError


def json_kwargs(output_cls: type[BaseModel],
                llm_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Chat options that force the output to JSON valid against ``output_cls``'s schema."""
    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise TypeError(f"output_cls must be a pydantic BaseModel subclass, got "
                        f"{output_cls!r:.60}")
    if llm_kwargs is not None and not isinstance(llm_kwargs, Mapping):
        raise TypeError(f"llm_kwargs must be a dict of chat options, got "
                        f"{type(llm_kwargs).__name__}")
    return {**(llm_kwargs or {}), "constraint": JsonSchema(output_cls.model_json_schema())}


def _cut_structured(output_cls: type[Any], response: ChatResponse) -> None:
    """Raise ``OutputTruncatedError`` when the engine says max_tokens cut the response's
    JSON (``raw["truncated"]``, from ``Completion.truncated``)."""
    raw = response.raw if isinstance(response.raw, Mapping) else {}
    if not raw.get("truncated"):
        return
    usage = raw.get("usage")
    tokens = int((usage if isinstance(usage, Mapping) else {}).get("completion_tokens") or 0)
    raise OutputTruncatedError(
        tokens, tokens, f"the JSON for {getattr(output_cls, '__name__', 'the output')}")


def parse_structured(output_cls: type[Any], response: ChatResponse) -> Any:
    """``output_cls`` from a constrained response; ``OutputTruncatedError`` (naming
    max_tokens) when max_tokens cut the JSON, instead of a field-level error."""
    _cut_structured(output_cls, response)
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(f"the model's JSON for {output_cls.__name__} did not validate: "
                         f"{text[:200]!r}") from exc


def check_structured_chunk(output_cls: type[Any], response: ChatResponse) -> None:
    """A streamed structured response: its last chunk raises if max_tokens cut the JSON
    (earlier chunks carry no finish reason and pass as partial objects)."""
    _cut_structured(output_cls, response)

