"""One request's logprobs in OpenAI's shape, for the faces (``engine.openai_logprobs``).

Token ids become text with the engine's tokenizer, read when the first logprobs arrive:
the model is loaded by then, so building a request never waits for a load (nor blocks
an event loop on one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import Engine, TokenLogprob, TokenText, openai_logprobs, token_texts


class RequestLogprobs:
    """Converts a request's ``TokenLogprob`` values; None throughout unless it asked."""

    def __init__(self, engine: Engine, asked: bool) -> None:
        """``asked``: the request's ``SamplingParams.logprobs``."""
        self.engine = engine
        self.asked = asked
        self._text: TokenText | None = None

    def __call__(self, tokens: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"content": [...]}`` for these tokens (empty when there are none)."""
        if not self.asked:
            return None
        if self._text is None:
            self._text = token_texts(self.engine.tokenizer)
        return openai_logprobs(tokens or (), self._text)
