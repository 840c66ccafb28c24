"""The text markers a tokenizer's output uses for reasoning and tool calls, and its parser.

mlx-lm's ``TokenizerWrapper`` knows them from the tokenizer and chat template (thinking
tokens, the family's tool-call markers and parser); without them, calls are the tagged
JSON the fallback tool prompt describes. No model, no mlx.
"""

from __future__ import annotations

from typing import Any

from engine.requests.inbound.tool_prompts import TOOL_CALL_END, TOOL_CALL_START
from engine.requests.outbound.channels import REASONING, TOOL
from engine.requests.outbound.tool_calls import ToolParser


def channel_markers(tokenizer: Any) -> dict[str, tuple[str, str]]:
    """Text markers of reasoning and tool calls for this tokenizer."""
    markers = {TOOL: (TOOL_CALL_START, TOOL_CALL_END)}
    if tokenizer.has_tool_calling:
        markers[TOOL] = (tokenizer.tool_call_start, tokenizer.tool_call_end)
    if tokenizer.has_thinking:
        markers[REASONING] = (tokenizer.think_start, tokenizer.think_end)
    return markers


def tool_parser(tokenizer: Any) -> ToolParser | None:
    """The model's own tool-call parser (mlx-lm's), or None for tagged JSON."""
    return tokenizer.tool_parser if tokenizer.has_tool_calling else None
