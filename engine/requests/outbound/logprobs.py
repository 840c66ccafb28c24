"""Token log-probabilities in OpenAI's ``logprobs`` shape: the one conversion every face uses.

The engine reports a ``TokenLogprob`` per generated token (ids and numbers). OpenAI's chat
completions, ``ChatOpenAI``'s ``response_metadata["logprobs"]`` and LlamaIndex's
``LogProb`` all speak of token *text* instead::

    {"content": [{"token": " Paris", "logprob": -0.01, "bytes": [32, 80, 97, 114, 105, 115],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.01, "bytes": [...]},
                                   ...]},
                 ...],
     "refusal": None}

``token`` is the token decoded on its own (a token holding part of a multi-byte character
decodes to U+FFFD, as the tokenizer writes it) and ``bytes`` the token's own bytes, from
its vocabulary (``token_bytes``), so the bytes of consecutive tokens add up to the UTF-8 of
their text; where the vocabulary is not read, the UTF-8 of the token's text.
Pure: the caller passes how a token id becomes text (``token_texts`` of its tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from engine.requests.outbound.results import TokenLogprob
from engine.requests.outbound.token_bytes import token_bytes

TokenText = Callable[[int], str]  # token id -> its text


class DecodedToken(str):
    """A token's text that also carries the token's own bytes (``raw``): a plain ``str``
    to whoever reads it as text, so it passes through the faces' ``TokenText`` wrappers."""

    raw: bytes | None

    def __new__(cls, text: str, raw: bytes | None) -> DecodedToken:
        """``text`` as decoded alone; ``raw`` None where the vocabulary was not read."""
        token = super().__new__(cls, text)
        token.raw = raw
        return token


def token_texts(tokenizer: Any) -> TokenText:
    """A token's text with ``tokenizer`` (with its bytes: ``DecodedToken``), remembered
    per id: a response lists each token with up to 20 alternatives, and the same ids come
    back again and again."""
    own_bytes = token_bytes(tokenizer)

    @lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return DecodedToken(str(tokenizer.decode([token_id])), own_bytes(token_id))

    return text


def openai_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    """One ``{"token", "logprob", "bytes"}`` entry."""
    text = token_text(token_id)
    raw = getattr(text, "raw", None)
    # str(): a plain string for the JSON encoders, whatever subclass carried the bytes.
    return {"token": str(text), "logprob": logprob,
            "bytes": list(raw if raw is not None else text.encode())}


def openai_logprobs(logprobs: Sequence[TokenLogprob] | None,
                    token_text: TokenText) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` object (``{"content": [...], "refusal": None}``) for some
    tokens: each the chosen token's entry with its ``top_logprobs`` (most likely first;
    empty unless alternatives were asked for). None when logprobs were not asked for.

    ``refusal`` (the tokens of a model's refusal message) is always None here, as OpenAI
    sends it for an answer that is no refusal; clients read both keys.
    """
    if logprobs is None:
        return None
    return {"content": [
        {**openai_token(lp.token_id, lp.logprob, token_text),
         "top_logprobs": [openai_token(tid, value, token_text) for tid, value in lp.top]}
        for lp in logprobs], "refusal": None}
