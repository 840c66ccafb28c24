"""Token log-probabilities in the legacy completions' ``logprobs`` shape.

``/v1/completions`` answers with four parallel lists instead of chat's list of entries::

    {"tokens": [" Paris", "."], "token_logprobs": [-0.01, -0.3],
     "top_logprobs": [{" Paris": -0.01, " Lyon": -4.2}, {".": -0.3, ",": -1.5}],
     "text_offset": [23, 29]}

The numbers are the engine's, as every door reports them (``TokenLogprob``); a token's text
is ``token_text``'s (the one every door uses). ``top_logprobs`` holds the ``logprobs`` most
likely tokens and the chosen one, as OpenAI's does ("up to logprobs+1 elements"); two ids
that decode to the same text share one key (the likelier one's number: the dict's
limit). ``text_offset`` is where each token starts in the choice's text: the echoed
prompt's length, then each token's text after the one before, so offsets and tokens agree
as clients slice them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import TokenLogprob, TokenText


@dataclass
class LegacyLogprobs:
    """One choice's logprobs as they stream: each ``take`` converts the next tokens, their
    offsets following the ones before (``offset`` starts at the echoed prompt's length)."""

    token_text: TokenText
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def take(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The legacy object for these tokens (a stream chunk's); kept for ``whole``."""
        tokens: list[str] = []
        top_logprobs: list[dict[str, float]] = []
        offsets: list[int] = []
        for lp in logprobs:
            text = str(self.token_text(lp.token_id))  # str(): a plain one for the encoders
            top: dict[str, float] = {}
            for token_id, value in lp.top:  # most likely first: the first of a text wins
                top.setdefault(str(self.token_text(token_id)), value)
            top.setdefault(text, lp.logprob)
            tokens.append(text)
            top_logprobs.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        values = [lp.logprob for lp in logprobs]
        self.tokens += tokens
        self.token_logprobs += values
        self.top_logprobs += top_logprobs
        self.text_offset += offsets
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def whole(self) -> dict[str, Any]:
        """Every token taken so far (the non-streamed choice's)."""
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
