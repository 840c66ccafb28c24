"""A LlamaIndex agent's structured output without a second model call.

``FunctionAgent(output_cls=...)`` ends each run by asking the LLM once more to format
the whole conversation (``llama_index.core.agent.utils.generate_structured_response``:
the history as one XML-ish transcript, then ``as_structured_llm(output_cls)``). When the
LLM's own answers already follow ``output_cls`` (``MLXBatchLLM(output_cls=...)``: every
agent turn is a tool call or JSON for the schema, one grammar), the transcript's last
assistant message *is* the structured output; asking again costs a whole request for
the same JSON. ``transcript_answer`` finds it. Pure: no engine here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from pydantic import BaseModel, ValidationError

# The transcript's last message section, when it is the assistant's: nothing follows it but
# the end of the conversation (the shape ``messages_to_xml_format`` writes). A message body
# never spans a ``</message>``, so a match cannot reach back across other sections.
_BODY = r"<message>((?:(?!</message>).)*)</message>"
_LAST_ASSISTANT = re.compile(
    rf"<assistant>\s*((?:{_BODY}\s*)+)</assistant>\s*</current_conversation>", re.DOTALL)
_MESSAGE = re.compile(_BODY, re.DOTALL)


def transcript_answer(output_cls: type[BaseModel],
                      messages: Sequence[ChatMessage]) -> BaseModel | None:
    """The agent's final answer as ``output_cls``, when ``messages`` are LlamaIndex's
    "format this conversation" request and the conversation ends in an assistant message
    that is already valid JSON for it; None otherwise (then the model is asked)."""
    if not messages:
        return None
    section = _LAST_ASSISTANT.search(_text(messages[-1]))
    if section is None:
        return None
    bodies = _MESSAGE.findall(section.group(1))
    try:
        return output_cls.model_validate_json(bodies[-1])
    except ValidationError:
        return None


def _text(message: ChatMessage) -> str:
    content: Any = message.content
    return content if isinstance(content, str) else ""
