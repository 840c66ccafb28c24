"""A row out of mlx-lm's generator, decoded by speculation: its own cache and what it has
decided but not fed. The batch lane's row record holds one while the row speculates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.drafts import Acceptance
from engine.core.lane import LaneRow
from engine.requests.constraints.grammar import RowGrammar


@dataclass
class SpeculatingRow:
    """A row decoded outside the generator: its cache and the tokens not yet in it."""

    row: LaneRow
    cache: list[Any]
    history: list[int]  # the tokens its cache holds
    pending: int  # the last token, decided (and reported) but not yet fed
    acceptance: Acceptance
    idle: int = 0  # consecutive steps without a draft
    trims: bool = True  # rejected tokens are trimmed; else the cache is rolled back
    # Decided and reported, fed by a forward that was rolled back: fed before ``pending``.
    backlog: list[int] = field(default_factory=list)
    grammar: RowGrammar | None = None  # a constrained row's matcher, ``pending`` consumed
    words: int = 0  # the grammar's bitmask width (32-bit words)

    @property
    def unfed(self) -> list[int]:
        """Everything decided that the cache does not hold yet, in order."""
        return [*self.backlog, self.pending]
