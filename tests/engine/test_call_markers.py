"""A call the model means to close, closed: the dialect's markers refused inside argument
strings (``string_markers``).

The tiny model is steered to write what the default model once wrote deep in an agent's
history: ``Paris}}</tool_call>You can...`` inside the ``city`` string, spelled in ordinary
tokens (its ``</tool_call>`` token is refused in strings by the grammar already). Without the
guard the marker lands in the argument; with it, the token that would complete the marker
is refused, the row closes the string (it favours a quote next), and the call is valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from engine import ChatRequest, Engine
from tests.conftest import greedy

NOTE = {"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}
ASK = [{"role": "user", "content": "Take a note about Paris."}]


def steered(eng: Engine, ids: list[int], quote_bias: float) -> Callable[[Any, Any], Any]:
    """Greedy writes ``ids`` while the grammar lets it; a quote is favoured over the rest."""
    quote = eng.tokenizer.encode('"', add_special_tokens=False)[0]
    start: list[int] = []

    def process(tokens: Any, logits: Any) -> Any:
        written = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if not start:
            start.append(len(written))
        out = written[start[0]:]
        bias = mx.zeros(logits.shape[-1]).at[quote].add(quote_bias)
        if out == ids[:len(out)] and len(out) < len(ids):
            bias = bias.at[ids[len(out)]].add(1e4)
        return logits + bias

    return process


def escaping_call(eng: Engine) -> list[int]:
    """The call with ``</tool_call>`` spelled in ordinary tokens inside its string."""
    encode: Callable[[str], list[int]] = lambda text: eng.tokenizer.encode(  # noqa: E731
        text, add_special_tokens=False)
    head = encode('<tool_call>\n{"name": "note", "arguments": {"text": "Paris}}')
    return [*head, *encode("</"), *encode("tool_call>"), *encode('You can"}}\n'),
            *encode("</tool_call>")]


@pytest.mark.parametrize("guarded", [True, False])
def test_a_close_marker_inside_an_argument_string_is_refused(tiny_engine: Engine,
                                                            guarded: bool) -> None:
    compiler = tiny_engine._runtime.preparer().compiler
    if not guarded:  # the engine as it was: any text in a free string
        compiler.call_markers = ()
    params = greedy(60, logits_processors=(steered(tiny_engine, escaping_call(tiny_engine),
                                                   quote_bias=30.0),))
    result = tiny_engine.submit(ChatRequest.from_openai(
        ASK, params, tools=[NOTE], tool_choice="required",
        parallel_tool_calls=False)).result(timeout=60)
    assert len(result.tool_calls) == 1, result.text
    text = result.tool_calls[0].arguments["text"]
    if guarded:
        assert "</tool_call>" not in text and text.startswith("Paris}}</tool_call"), text
    else:
        assert text == "Paris}}</tool_call>You can", text
