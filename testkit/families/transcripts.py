"""A tool-call turn in a family's native syntax, rendered by its own chat template.

The prompt is a user question with a ``get_weather`` tool; the completion is what the
template writes for an assistant message holding that call (Qwen3's ``<tool_call>`` JSON,
Llama 3.1's ``{"name": ..., "parameters": ...}``, Mistral's ``[TOOL_CALLS]``...), up to and
including the end of the turn. Where a template cannot render calls, ``raw_completion`` is
the family's documented raw form, given by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
QUESTION = "What is the weather in Paris?"
CALL_ARGUMENTS = {"city": "Paris"}
# Mistral's templates accept only 9 alphanumerics; every other template takes these too.
CALL_ID = "a1b2c3d4e"


@dataclass(frozen=True)
class ToolTurn:
    """A rendered prompt (ending with the generation prompt) and the completion after it."""

    prompt: str
    completion: str


def tool_call_message(arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """An assistant message holding one ``get_weather`` call, OpenAI-shaped."""
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": CALL_ID, "type": "function",
        "function": {"name": "get_weather", "arguments": arguments or CALL_ARGUMENTS},
    }]}


def tool_call_turn(tokenizer: Any, end_of_turn: str, *, raw_completion: str | None = None,
                   **template_kwargs: Any) -> ToolTurn:
    """The family's tool-call turn: rendered by ``tokenizer.apply_chat_template`` (any HF
    tokenizer or mlx-lm wrapper), cut after the first ``end_of_turn`` of the completion."""
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = {"tools": [WEATHER_TOOL], "tokenize": False, **template_kwargs}
    prompt = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
    if raw_completion is not None:
        return ToolTurn(prompt, raw_completion)
    whole = str(tokenizer.apply_chat_template([*messages, tool_call_message()], **kwargs))
    if not whole.startswith(prompt):
        raise ValueError("the template renders the history differently once the call is in "
                         "it; give the family's raw completion instead")
    completion = whole[len(prompt):]
    end = completion.find(end_of_turn)
    if end < 0:
        raise ValueError(f"the rendered call has no end of turn {end_of_turn!r}")
    return ToolTurn(prompt, completion[: end + len(end_of_turn)])
