"""Prompt-lookup drafts: guess a row's next tokens from its own prompt and output (no mlx).

An answer that quotes its context, edits code it was shown, or repeats a name tends to
continue the way an earlier occurrence of its last few tokens continued. The draft is
what followed the most recent earlier occurrence of the longest suffix (``max_ngram``
down to ``min_ngram`` tokens) of the row's tokens; the model then checks the whole
draft in one forward and keeps the part it agrees with.
"""

from __future__ import annotations

from collections.abc import Sequence


def lookup_draft(tokens: Sequence[int], length: int, max_ngram: int = 4,
                 min_ngram: int = 2) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier match of the tokens' tail."""
    count = len(tokens)
    if length <= 0 or count < 2:
        return []
    for n in range(min(max_ngram, count - 1), min_ngram - 1, -1):
        tail = list(tokens[count - n:])
        # Latest match first: recent context predicts best; the tail itself is excluded.
        for start in range(count - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start:start + n]) == tail:
                # Copy what followed; a match close to the end runs on into the draft
                # itself, which continues a repeating pattern.
                copied = list(tokens)
                for i in range(length):
                    copied.append(copied[start + n + i])
                return copied[count:]
    return []


class Acceptance:
    """A row's running mean of accepted draft tokens per draft (exponentially weighted).

    Fed by drafts the model checked and by drafts only compared with what the row went on
    to decode; the caller compares the mean with what a check costs at the current load.
    """

    def __init__(self, weight: float = 0.3, start: float = 0.0) -> None:
        self.weight = weight
        self.mean = start
        self.drafts = 0
        self.accepted = 0

    def record(self, accepted: int) -> None:
        self.drafts += 1
        self.accepted += accepted
        self.mean += self.weight * (accepted - self.mean)


class ShadowDraft:
    """A row's draft compared with the tokens it goes on to decode, at no cost.

    While a row decodes in the batch, each new token is checked against the draft made
    before it; a miss, or the draft used up, records how many tokens it got right in the
    row's ``Acceptance``. That record is how a row earns its first real check.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.acceptance = Acceptance()
        self.draft: list[int] = []
        self._matched = 0
        self._seen = 0  # tokens observed so far

    def observe(self, tokens: Sequence[int]) -> bool:
        """``tokens``: the row's prompt and output, the newest last (a step may bring
        several: a forced span, a chain of them). True if a draft is ready for what
        comes next."""
        for token in tokens[self._seen or len(tokens) - 1:]:
            if not self.draft:
                break
            hit = token == self.draft[self._matched]
            self._matched += hit
            if not hit or self._matched == len(self.draft):
                self.acceptance.record(self._matched)
                self.draft, self._matched = [], 0
        self._seen = len(tokens)
        if not self.draft:
            self.draft = lookup_draft(tokens, self.length)
        return bool(self.draft)

    def reset(self) -> None:
        """The row checks its drafts for real now: the shadow starts again afterwards."""
        self.draft, self._matched, self._seen = [], 0, 0
