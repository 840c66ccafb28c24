"""When image work runs: a credit each step earns, spent by units of work.

A vision row's own prefill (its tower, then its prompt up to its last image) runs in units
between the lane's steps. While rows decode, each step earns image work a budget (a share
of a decode step's measured time, ``StepCosts.image_budget``) and a unit runs only while
the credit is positive; what a unit costs past it is repaid by later steps, so on average
the decoding rows keep 1/(1 + share) of their pace however coarse a unit is. With no row
decoding the work runs to its end; before any step is measured, one unit a step.
"""

from __future__ import annotations


class ImageSchedule:
    """The credit image work holds between steps (negative: owed to the decoding rows)."""

    def __init__(self) -> None:
        self.credit = 0.0
        self._budget: float | None = None
        self._units = 0

    def earn(self, budget: float | None) -> None:
        """A step begins with ``budget`` seconds earned (None: no row decodes; 0: nothing
        measured yet). Credit carries over, up to two steps' worth."""
        self._budget, self._units = budget, 0
        if not budget:
            self.credit = 0.0
        else:
            self.credit = min(self.credit + budget, 2 * budget)

    def may_run(self) -> bool:
        """Whether another unit runs in this step (counted as started)."""
        budget = self._budget
        if budget is None or self.credit > 0 or (budget == 0 and not self._units):
            self._units += 1
            return True
        return False

    def left(self) -> float | None:
        """Seconds a unit may take now (None: no limit)."""
        return None if self._budget is None else self.credit

    def spent(self, seconds: float) -> None:
        """A unit took ``seconds``: paid from the credit while rows decode."""
        if self._budget:
            self.credit -= seconds

    def idle(self) -> None:
        """No image work is left: no saving up for the next image (a debt stays)."""
        self.credit = min(self.credit, 0.0)

    @staticmethod
    def chunk(chunk: int, left: float | None, token_seconds: float) -> int:
        """A prefill unit's tokens: the lane's ``chunk``, cut to what ``left`` seconds pay
        for at ``token_seconds`` a token (at least 8, so a unit always moves)."""
        if left is None or token_seconds <= 0:
            return chunk
        return max(8, min(chunk, int(left / token_seconds)))
