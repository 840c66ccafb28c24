"""One request's logprobs in OpenAI's shape, for the faces (``engine.openai_logprobs``).

Token ids become text with the engine's tokenizer, read when the first logprobs arrive:
the model is loaded by then, so building a request never waits for a load (nor blocks
an event loop on one). The texts are remembered per engine, across requests: 16 streams
of 128 tokens with 5 alternatives each looked up 11,034 texts and, with a cache per
request, decoded 6,616 of them (half the time the face spent on logprobs).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

from engine import Engine, TokenLogprob, TokenText, openai_logprobs, token_texts

# An engine's token texts, as long as the engine lives (the texts hold its tokenizer only).
_TEXTS: WeakKeyDictionary[Engine, TokenText] = WeakKeyDictionary()
_TEXTS_LOCK = threading.Lock()


def _texts_of(engine: Engine) -> TokenText:
    with _TEXTS_LOCK:
        texts = _TEXTS.get(engine)
        if texts is None:
            texts = _TEXTS[engine] = token_texts(engine.tokenizer)
        return texts


class RequestLogprobs:
    """Converts a request's ``TokenLogprob`` values; None throughout unless it asked."""

    def __init__(self, engine: Engine, asked: bool) -> None:
        """``asked``: the request's ``SamplingParams.logprobs``."""
        self.engine = engine
        self.asked = asked

    def __call__(self, tokens: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"content": [...], "refusal": None}`` for these tokens (content empty when
        there are none)."""
        if not self.asked:
            return None
        return openai_logprobs(tokens or (), _texts_of(self.engine))
