"""The lane protocol: where admitted rows run, as the step loop sees it.

A lane holds rows keyed by request id and does the only device work: ``insert`` starts
rows, ``step`` advances every row it holds by one unit (a prefill chunk or one token;
a constrained row may also append the tokens its grammar forces),
``remove`` lets rows go at any stage. A lane never decides that a row has ended: it
reports tokens, and ``engine.core.update`` decides. Two implementations: the shared batch
(``BatchLane``) and one row at a time for what cannot batch (``SerialLane``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from engine.core.reuse_key import position_shift
from engine.requests.inbound.prompts import PromptImage
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.outbound.results import TokenLogprob


class LaneKind(Enum):
    """The lanes, by one name everywhere: the scheduler's choice, the loop's lanes, the
    messages a sharded engine's rank 0 sends. The shared batch, or rows alone between
    batch steps (seeded sampling, caches that cannot merge)."""

    BATCH = "batch"
    SERIAL = "serial"


@dataclass(frozen=True)
class LaneRow:
    """A prepared request as a lane needs it."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none
    images: tuple[PromptImage, ...] = ()  # image spans, whose embeddings are the tower's

    @property
    def vision_end(self) -> int:
        """Where the prompt's last image span ends (0: no image)."""
        return max((image.start + image.length for image in self.images), default=0)

    @property
    def position_shift(self) -> int:
        """How far the text after the images is from its index in positions: nonzero
        where images sit on a grid of positions (M-RoPE)."""
        return position_shift(self.images)


@dataclass(frozen=True)
class RowToken:
    """One generated token of one row, and whether the row's grammar is now complete.

    ``forced``: the row's grammar allowed nothing else, so the token was fed to the model
    with others in one forward instead of being sampled in a step of its own.
    ``drafted``: guessed by prompt lookup and confirmed by the model in one forward.
    """

    request_id: int
    token: int
    logprob: TokenLogprob | None = None
    grammar_done: bool = False
    forced: bool = False
    drafted: bool = False  # a speculative draft's token the model agreed with


@dataclass
class LaneStep:
    """What one step of a lane produced."""

    tokens: list[RowToken] = field(default_factory=list)
    failed: dict[int, BaseException] = field(default_factory=dict)  # the row's own code
    cached_tokens: dict[int, int] = field(default_factory=dict)  # reused prompt tokens
    width: int = 0  # rows that decoded in this step


@dataclass(frozen=True)
class LaneCapabilities:
    """What a lane's model takes beyond text; a row asking for more is refused by name
    before it starts (``StepCore``), alone."""

    images: bool = False  # the model has a vision tower
    adapters: bool = False  # the model serves per-row LoRA adapters

    def refusal(self, row: LaneRow) -> str | None:
        """Why this lane cannot run ``row``; None when it can."""
        if row.images and not self.images:
            return "this model reads no images"
        if row.params.adapter is not None and not self.adapters:
            return "this model serves no adapters (EngineConfig.max_adapters is 0)"
        return None


class Lane(Protocol):
    """One place rows run; every method is called on the engine thread only."""

    def accepts(self, row: LaneRow) -> str | None:
        """Why this lane cannot run ``row`` (``LaneCapabilities.refusal``); None if it can."""

    def insert(self, rows: Sequence[LaneRow]) -> None:
        """Start rows (each may reuse a cached KV prefix)."""

    def remove(self, request_ids: Sequence[int]) -> None:
        """Let rows go at any stage; their KV may be kept for prefix reuse."""

    def step(self) -> LaneStep:
        """Advance every row by one unit; raises only if the model itself failed."""

    def reset(self) -> list[int]:
        """Drop every row after a model failure; returns their request ids."""

    def __len__(self) -> int:
        """Rows held."""
