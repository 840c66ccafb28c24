"""Pure prefill policy for the batch lane: which admitted rows prefill now, and how.

The scheduler decides which requests are admitted; this planner decides, beside it and
with no device work and no mlx (unit-tested in ``tests/unit/test_prefill_planner.py``),
when each admitted row of the batch lane is given to mlx-lm's generator and in which
segments. The lane is handed a planner when it is built and asks it at every step; the
lane only carries out what it says (prefix lookups, stores, the generator):

- **shared heads**: rows admitted together that share a prompt prefix get it as their
  head, so the first (the leader) prefills and stores it and the others reuse it;
- **one group at a time**: rows are held while a row in flight is within a chunk of its
  prompt's end with no token yet, so a group's first tokens are not delayed by the next
  group's prefill, and at most ``group_size`` rows prefill at once;
- **twins wait for their leader**: a row whose head a leader is prefilling waits until the
  head is stored (or abandoned), then joins ahead of the queue;
- **segments**: a leader's prompt is split at its head, so the head can be stored there.

Heads are shared and split only where a prefix store can keep them (``head_min_tokens``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from engine.core.prefix_cache import common_prefix

HeadKey = tuple[int, ...]


class PlannedRow(Protocol):
    """What the planner reads of a row (the lane's own row type implements it)."""

    @property
    def request_id(self) -> int: ...

    @property
    def prompt(self) -> list[int]: ...

    @property
    def key(self) -> list[int]:
        """The prompt as prefix reuse keys it: rows share a head only where their KV is
        the same (``engine.core.reuse_key``)."""

    head_len: int  # the shared head's tokens: the chat head, or a prefix shared with twins


R = TypeVar("R", bound=PlannedRow)
P = TypeVar("P")


def head_of(row: PlannedRow) -> HeadKey | None:
    """The row's shared head as a key (None without one)."""
    return tuple(row.key[: row.head_len]) if row.head_len else None


def cluster_heads(rows: Sequence[PlannedRow], min_tokens: int) -> None:
    """Rows admitted together that share a prompt prefix prefill it once.

    Greedy clustering in arrival order: a row joins the first group whose common prefix
    with it is at least ``min_tokens`` (worth storing) and longer than every member's chat
    head, which shortens that group's key to what they all share. A group of two or more
    gets that prefix as its ``head_len``; a row that shares no more than its chat head
    keeps that head, which groups it with its twins.
    """
    if len(rows) < 2:
        return
    # (key, members, the longest chat head among them)
    groups: list[tuple[np.ndarray[Any, Any], list[PlannedRow], int]] = []
    for row in rows:
        prompt = np.asarray(row.key)
        for i, (key, members, floor) in enumerate(groups):
            shared = common_prefix(key, prompt)
            if shared >= min_tokens and shared > max(floor, row.head_len):
                groups[i] = (key[:shared], [*members, row], max(floor, row.head_len))
                break
        else:
            groups.append((prompt[:-1], [row], row.head_len))
    for key, members, _ in groups:
        if len(members) > 1:
            for member in members:
                member.head_len = int(key.shape[0])


class PrefillPlanner(Generic[R]):
    """The lane's queue of admitted rows and the rows it has given the generator.

    ``group_size``: rows prefilled at once; ``chunk``: the generator's prefill chunk;
    ``head_min_tokens``: the shortest prefix a store keeps, None without a store (then no
    head is shared or split out).
    """

    def __init__(self, group_size: int, chunk: int, *,
                 head_min_tokens: int | None = None) -> None:
        self.group_size = group_size
        self.chunk = chunk
        self.head_min_tokens = head_min_tokens
        self._queued: deque[R] = deque()
        # Rows given to the generator without a token yet: request id -> prompt tokens left.
        self._awaiting_first: dict[int, int] = {}
        self._heads_in_flight: dict[HeadKey, int] = {}  # head -> the leader prefilling it
        self._head_of_leader: dict[int, HeadKey] = {}
        self._deferred: dict[HeadKey, list[R]] = {}  # twins waiting for their head

    # ----- queueing ----------------------------------------------------------------------

    @classmethod
    def for_batch(cls, max_batch: int, prefill_batch: int, chunk: int, *,
                  head_min_tokens: int | None) -> PrefillPlanner[R]:
        """The planner for a lane of ``max_batch`` rows (a group never outgrows it)."""
        return cls(min(prefill_batch, max_batch), chunk, head_min_tokens=head_min_tokens)

    def queue(self, rows: Sequence[R], *, joining: bool = False) -> None:
        """Queue rows in order; ``joining`` rows (twins released by their head) go first.

        Rows admitted together (not ``joining``) that share a prefix a store would keep
        get it as their head first (``cluster_heads``).
        """
        if joining:
            self._queued.extendleft(reversed(rows))
            return
        if self.head_min_tokens is not None:
            cluster_heads(rows, self.head_min_tokens)
        self._queued.extend(rows)

    def take_ready(self, plan: Callable[[R], P],
                   joining: bool = False) -> list[tuple[R, P]]:
        """The queued rows to give the generator now, in order, each with ``plan(row)``.

        Nothing while a row in flight is within a chunk of its prompt's end and has no
        token yet (unless ``joining``: twins join their leader's group while it has room),
        and never more than the group has room for. A row whose head is being prefilled
        by its leader waits for it instead. ``plan`` runs as each row is taken (it calls
        ``segments``), so a leader taken first makes its twins behind it wait.
        """
        if not joining and any(left <= self.chunk for left in self._awaiting_first.values()):
            return []
        room = self.group_size - len(self._awaiting_first)
        ready: list[tuple[R, P]] = []
        while self._queued and len(ready) < room:
            row = self._queued.popleft()  # in order: a row with a new head leads it
            head = head_of(row)
            if head is not None and head in self._heads_in_flight:
                self._deferred.setdefault(head, []).append(row)
            else:
                ready.append((row, plan(row)))
        return ready

    def segments(self, row: R, reused: int) -> list[list[int]]:
        """The prompt segments to prefill after ``reused`` cached tokens.

        A row whose head is longer than what it reused stops at the head boundary once and
        becomes the head's leader: the lane stores the head there and its twins wait.
        """
        prompt, head, key = row.prompt, row.head_len, head_of(row)
        stores = self.head_min_tokens is not None
        if key is not None and stores and reused < head < len(prompt) - 1:
            self._heads_in_flight[key] = row.request_id
            self._head_of_leader[row.request_id] = key
            return [prompt[reused:head], prompt[head:]]
        return [prompt[reused:]]

    # ----- progress ----------------------------------------------------------------------

    def started(self, request_id: int, prompt_left: int) -> None:
        """The row was given to the generator with ``prompt_left`` tokens to prefill."""
        self._awaiting_first[request_id] = prompt_left

    def progressed(self, request_id: int, prompt_left: int) -> None:
        """The generator reported the row's prefill progress."""
        if request_id in self._awaiting_first:
            self._awaiting_first[request_id] = prompt_left

    def first_token(self, request_id: int) -> None:
        """The row has its first token: it no longer holds the next group back."""
        self._awaiting_first.pop(request_id, None)

    def leader_head(self, request_id: int) -> HeadKey | None:
        """The head this row prefills as its leader, if any."""
        return self._head_of_leader.get(request_id)

    def head_done(self, key: HeadKey) -> list[R]:
        """The head's prefill ended (stored or abandoned): the twins that waited for it."""
        leader = self._heads_in_flight.pop(key, None)
        if leader is not None:
            self._head_of_leader.pop(leader, None)
        return self._deferred.pop(key, [])

    def forget(self, row: R) -> list[R]:
        """The row left the lane; the twins it led, if it was a leader, to start now."""
        request_id = row.request_id
        self._awaiting_first.pop(request_id, None)
        if row in self._queued:
            self._queued.remove(row)
        key = head_of(row)
        waiting = self._deferred.get(key) if key is not None else None
        if waiting is not None and row in waiting:
            waiting.remove(row)
        head = self._head_of_leader.get(request_id)
        return self.head_done(head) if head is not None else []  # a twin becomes the leader

    def reset(self) -> None:
        self._queued.clear()
        self._awaiting_first.clear()
        self._deferred.clear()
        self._heads_in_flight.clear()
        self._head_of_leader.clear()

    @property
    def queued(self) -> int:
        return len(self._queued)
