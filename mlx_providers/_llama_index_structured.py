"""Structured output for ``structured_predict`` and its streams: the options that force JSON
valid against a pydantic class, the class parsed from the answer, a cut answer raised as
``OutputTruncatedError``, and partial objects as the JSON streams in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.llms.llm import LLM
from llama_index.core.program.utils import process_streaming_objects

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


class PartialObjects:
    """One structured stream's step, whichever iterator feeds it: each chunk of the
    constrained answer in turn gives the objects parsed so far (partial while the JSON is
    still open); the last chunk raises if max_tokens cut the JSON.

    The sync and async streams both map their chunks through one of these, so the
    partial-object logic exists once (``(step(r) for r in stream)`` or ``async for``).
    """

    def __init__(self, output_cls: type[Any], llm: LLM) -> None:
        """Nothing parsed yet; ``llm`` reads tool calls, should a chunk carry any."""
        self.output_cls = output_cls
        self.llm = llm
        self.current: list[Any] | None = None  # the previous chunk's objects, to build on

    def __call__(self, response: ChatResponse) -> Any:
        """The objects ``response`` (everything streamed so far) holds."""
        check_structured_chunk(self.output_cls, response)
        objects = process_streaming_objects(response, self.output_cls,
                                            cur_objects=self.current, flexible_mode=True,
                                            llm=self.llm)
        self.current = objects if isinstance(objects, list) else [objects]
        return objects
