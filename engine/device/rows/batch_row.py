"""A row of the batch lane as one record, the lane's rows, and the seam rows leave through.

Everything the lane and its collaborators know of a row is in its ``BatchRow``: its
request, grammar and sampler, what it has produced, where it is (in mlx-lm's generator
under a uid, or out of it to fast-forward or speculate), and the tokens in flight between
the lane and the generator. Forgetting a row is dropping its record from ``BatchRows``,
which also keeps the one index beside it (generator uid -> row).

Fast-forward and speculation feed a row several tokens outside the generator: they take
it out with its cache and put it back with what it decided but has not fed
(``RowSeam``; the lane implements it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.drafts import ShadowDraft
from engine.core.lane import LaneRow
from engine.core.reuse_key import RowContext, position_shift, reuse_key
from engine.device.rows.first_tokens import Sampler
from engine.device.rows.speculating_row import SpeculatingRow
from engine.requests.constraints.grammar import RowGrammar


@dataclass(eq=False)  # rows are compared by identity: two requests may look alike
class BatchRow:
    """A row the lane holds, from insert to remove."""

    row: LaneRow
    grammar: RowGrammar | None = None
    failure: BaseException | None = None  # a failure of the row's own code: it ends alone
    cached_tokens: int = 0
    head_len: int = 0  # the row's shared head: its chat head, or a prefix it shares
    sampler: Sampler | None = None  # as handed to the generator (wrapped by the tap)
    output: list[int] = field(default_factory=list)  # tokens reported, forced ones included
    shadow: ShadowDraft | None = None  # its drafts, compared with what it decodes
    uid: int | None = None  # in the generator under this uid; None while queued or out
    report_cached: bool = False  # ``cached_tokens`` not yet reported in a ``LaneStep``
    # Reported before the generator returns it: the first token read from the sampler tap.
    early: int | None = None
    # The next input a direct rejoin handed the generator, which returns it next step.
    echo: int | None = None
    speculating: SpeculatingRow | None = None  # out of the generator, decoded by speculation
    # An image row's own prefill, done (``vision.prefill``): its cache and the tokens it holds.
    vision_ready: tuple[list[Any], int] | None = None
    adapter: str | None = None  # the LoRA adapter it holds (``row_adapters``)
    slot: int = 0  # its adapter's slot (0: the base)

    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def request_id(self) -> int:
        return self.row.request_id

    @property
    def prompt(self) -> list[int]:
        return self.row.prompt

    @property
    def context(self) -> RowContext:
        """What besides its tokens decides this row's KV (its images, shift, adapter)."""
        return RowContext(self.row.images, self.adapter)

    @property
    def key(self) -> list[int]:
        """The prompt as prefix reuse keys it (what the prefill planner groups heads by)."""
        return self.keyed(self.row.prompt)

    def keyed(self, tokens: list[int]) -> list[int]:
        """``tokens`` of this row as prefix reuse keys them (``engine.core.reuse_key``)."""
        return reuse_key(tokens, self.context)

    def resume_frames(self) -> list[int]:
        """The shifts a cached prefix of this row may be kept at, most images first: its
        own, then each shorter run of its images' (an earlier turn's cache, kept at that
        turn's shift, which the row's own prefill turns on to its own). One, where its
        images sit on no grid of positions."""
        images = sorted(self.row.images, key=lambda i: i.start)
        frames = [position_shift(tuple(images[:k])) for k in range(len(images), -1, -1)]
        return list(dict.fromkeys(frames)) if any(i.grid for i in images) else frames[:1]

    def keyed_at(self, tokens: list[int], frame: int) -> list[int]:
        """``tokens`` keyed as a cache kept at shift ``frame`` would be."""
        return reuse_key(tokens, RowContext(self.row.images, self.adapter, frame))


class BatchRows:
    """The lane's rows by request id, in insertion order, and by generator uid.

    ``by_request`` and ``by_uid`` are read-only views for the step's hot loops (a plain
    dict lookup each); only the methods here change them, so the two never disagree.
    """

    def __init__(self, uid_slots: dict[int, int] | None = None) -> None:
        self._by_request: dict[int, BatchRow] = {}
        self._by_uid: dict[int, BatchRow] = {}
        self.by_request: Mapping[int, BatchRow] = self._by_request
        self.by_uid: Mapping[int, BatchRow] = self._by_uid
        # Adapter rows' slots by uid (the model's ``RowAdapters.uid_slots``: the batch
        # forwards read it); kept with the uids, so it never disagrees with them.
        self.uid_slots: dict[int, int] = {} if uid_slots is None else uid_slots

    def add(self, row: BatchRow) -> None:
        self._by_request[row.request_id] = row

    def get(self, request_id: int) -> BatchRow | None:
        return self._by_request.get(request_id)

    def __getitem__(self, request_id: int) -> BatchRow:
        return self._by_request[request_id]

    def of_uid(self, uid: int) -> BatchRow | None:
        """The row the generator knows as ``uid`` (None once it left or was forgotten)."""
        return self._by_uid.get(uid)

    def joined(self, row: BatchRow, uid: int) -> None:
        """The row entered the generator as ``uid``."""
        row.uid = uid
        self._by_uid[uid] = row
        if row.slot:  # its adapter's slot, for the batch forwards it is in
            self.uid_slots[uid] = row.slot

    def left(self, row: BatchRow) -> int:
        """The row leaves the generator; returns the uid it had there."""
        uid = row.uid
        assert uid is not None, "only a row in the generator can leave it"
        row.uid = None
        del self._by_uid[uid]
        self.uid_slots.pop(uid, None)
        return uid

    def forget(self, request_id: int) -> BatchRow | None:
        """Drop the row's record (and its uid with it); None if the lane did not hold it."""
        row = self._by_request.pop(request_id, None)
        if row is not None and row.uid is not None:
            self._by_uid.pop(row.uid, None)
            self.uid_slots.pop(row.uid, None)
        return row

    def in_generator(self) -> list[BatchRow]:
        """The rows in the generator now (queued or out of it: not listed)."""
        return list(self._by_uid.values())

    def __iter__(self) -> Iterator[BatchRow]:
        """The rows in insertion order (forget none while iterating: iterate ``list(...)``)."""
        return iter(self._by_request.values())

    def __len__(self) -> int:
        return len(self._by_request)


@dataclass(eq=False)
class OutRow:
    """A row out of the generator: its cache, the tokens that cache holds, and the tokens
    decided (forced or sampled, already reported) but not fed yet."""

    row: BatchRow
    cache: list[Any]
    history: list[int]
    unfed: list[int] = field(default_factory=list)


class RowSeam(Protocol):
    """How a collaborator takes decoding rows out of mlx-lm's generator and puts them back
    (the batch lane implements it; called on the engine thread, inside a lane step)."""

    def take_out(self, rows: Sequence[BatchRow]) -> list[OutRow]:
        """Remove decoding rows from the generator, each with its cache (nothing unfed)."""

    def put_back(self, rows: Sequence[OutRow]) -> None:
        """Rows rejoin the generator from their caches, their ``unfed`` tokens fed first."""

    def decoding(self, row: BatchRow) -> bool:
        """Whether the row is in the generator's decoding batch (not queued, not prefilling)."""

    def next_inputs(self, rows: Sequence[BatchRow]) -> list[tuple[int, Any]]:
        """The token the generator's next step would feed each decoding row, and the
        logprobs it was chosen from (it sampled it in the step that returned the row's last
        token: mlx-lm runs one step ahead)."""
