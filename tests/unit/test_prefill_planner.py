"""engine.core.prefill_planner: when admitted rows prefill and how, with no model."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.prefill_planner import PrefillPlanner, cluster_heads, head_of


@dataclass(eq=False)
class Row:
    request_id: int
    prompt: list[int]
    head_len: int = 0
    tag: int | None = None  # a reuse context's tag on the first token (an adapter, a shift)

    @property
    def key(self) -> list[int]:
        return [self.tag, *self.prompt[1:]] if self.tag is not None else self.prompt


def planner(group: int = 4, chunk: int = 8, reuse: bool = True) -> PrefillPlanner[Row]:
    """A planner beside a prefix store keeping prefixes of 16 tokens or more (``reuse``)."""
    return PrefillPlanner(group, chunk, head_min_tokens=16 if reuse else None)


def take(p: PrefillPlanner[Row], joining: bool = False,
         reused: int = 0) -> list[tuple[int, list[list[int]]]]:
    """The rows taken now, each with the segments the planner gives it."""
    taken = p.take_ready(lambda row: p.segments(row, reused), joining)
    return [(row.request_id, segments) for row, segments in taken]


def test_cluster_heads_gives_rows_sharing_a_long_prefix_that_prefix_as_head() -> None:
    shared = list(range(100, 120))
    a, b = Row(1, [*shared, 1, 2]), Row(2, [*shared, 3, 4, 5])
    lone = Row(3, [7, 7, 7, 7])
    cluster_heads([a, b, lone], min_tokens=16)
    assert a.head_len == b.head_len == 20
    assert lone.head_len == 0
    assert head_of(a) == head_of(b) == tuple(shared)


def test_cluster_heads_ignores_prefixes_too_short_to_store_or_within_a_chat_head() -> None:
    short = [Row(1, [1, 2, 3, 9]), Row(2, [1, 2, 3, 8])]
    cluster_heads(short, min_tokens=16)
    assert [r.head_len for r in short] == [0, 0]
    # Sharing no more than their chat head, rows keep that head (it groups them anyway).
    head = list(range(30))
    twins = [Row(1, [*head, 5], head_len=30), Row(2, [*head, 6], head_len=30)]
    cluster_heads(twins, min_tokens=16)
    assert [r.head_len for r in twins] == [30, 30]


def test_cluster_heads_shortens_a_group_key_to_what_every_member_shares() -> None:
    base = list(range(40))
    rows = [Row(1, [*base, 1]), Row(2, [*base, 2]), Row(3, [*base[:25], 99, 98])]
    cluster_heads(rows, min_tokens=16)
    assert [r.head_len for r in rows] == [25, 25, 25]


def test_a_group_prefills_at_most_group_size_rows_at_once() -> None:
    p = planner(group=2)
    p.queue([Row(i, [i] * 50) for i in range(1, 5)])
    first = take(p)
    assert [rid for rid, _ in first] == [1, 2]
    for rid, segments in first:
        p.started(rid, sum(len(s) for s in segments))
    assert take(p) == []  # no room until a row has its first token
    p.first_token(1)
    assert [rid for rid, _ in take(p)] == [3]


def test_rows_wait_while_a_row_in_flight_is_within_a_chunk_of_its_first_token() -> None:
    p = planner(group=4, chunk=8)
    p.queue([Row(1, [1] * 30)])
    (rid, _), = take(p)
    p.started(rid, 30)
    p.queue([Row(2, [2] * 30)])
    p.progressed(1, 20)  # more than a chunk to go: the next row may start beside it
    assert [r for r, _ in take(p)] == [2]
    p.started(2, 30)
    p.queue([Row(3, [3] * 30)])
    p.progressed(1, 8)  # within a chunk of its first token: hold the next group back
    assert take(p) == []
    assert p.queued == 1
    p.first_token(1)
    p.progressed(2, 25)
    assert [r for r, _ in take(p)] == [3]


def test_a_leader_stops_at_its_head_and_its_twins_wait_for_it() -> None:
    head = list(range(20))
    leader, twin = Row(1, [*head, 1, 2], head_len=20), Row(2, [*head, 3, 4], head_len=20)
    p = planner()
    p.queue([leader, twin])
    taken = take(p)
    assert taken == [(1, [head, [1, 2]])]  # split at the head, so it can be stored there
    assert p.leader_head(1) == tuple(head)
    assert p.queued == 0  # the twin moved to wait for the head
    released = p.head_done(tuple(head))
    assert released == [twin]
    assert p.leader_head(1) is None


def test_rows_of_another_reuse_context_never_wait_for_a_head_they_cannot_reuse() -> None:
    """An adapter row and a base row with the same chat head hold different KV: the base
    row prefills at once instead of waiting for a head it would not find."""
    head = list(range(20))
    adapter_row = Row(1, [*head, 1, 2], head_len=20, tag=-(1 << 62))
    base_row, base_twin = Row(2, [*head, 3, 4], head_len=20), Row(3, [*head, 5], head_len=20)
    p = planner()
    p.queue([adapter_row, base_row, base_twin])
    taken = take(p)
    assert [row for row, _ in taken] == [1, 2]  # the base row leads its own head
    assert p.leader_head(1) == (-(1 << 62), *head[1:])
    assert p.leader_head(2) == tuple(head)
    assert p.head_done(tuple(head)) == [base_twin]


def test_a_row_that_reused_its_head_is_not_split() -> None:
    head = list(range(20))
    p = planner()
    p.queue([Row(1, [*head, 1, 2], head_len=20)])
    assert take(p, reused=20) == [(1, [[1, 2]])]
    assert p.leader_head(1) is None


def test_without_reuse_nothing_is_split_and_no_twin_waits() -> None:
    head = list(range(20))
    p = planner(reuse=False)
    p.queue([Row(1, [*head, 1], head_len=20), Row(2, [*head, 2], head_len=20)])
    assert take(p) == [(1, [[*head, 1]]), (2, [[*head, 2]])]


def test_joining_rows_go_first_and_ignore_the_chunk_hold() -> None:
    p = planner(group=4, chunk=8)
    p.queue([Row(1, [1] * 10)])
    (rid, _), = take(p)
    p.started(rid, 4)  # within a chunk: ordinary rows wait
    later = Row(2, [2] * 10)
    p.queue([later])
    assert take(p) == []
    twin = Row(3, [3] * 10)
    p.queue([twin], joining=True)
    assert [r for r, _ in take(p, joining=True)] == [3, 2]


def test_forgetting_a_leader_releases_its_twins_and_a_queued_row_leaves_the_queue() -> None:
    head = list(range(20))
    leader, twin = Row(1, [*head, 1, 2], head_len=20), Row(2, [*head, 3, 4], head_len=20)
    p = planner()
    p.queue([leader, twin])
    take(p)
    assert p.forget(leader) == [twin]  # abandoned: the twin leads now
    queued = Row(5, [5] * 10)
    p.queue([queued])
    assert p.forget(queued) == []
    assert p.queued == 0


def test_forgetting_a_waiting_twin_drops_it_from_the_wait() -> None:
    head = list(range(20))
    leader, twin = Row(1, [*head, 1, 2], head_len=20), Row(2, [*head, 3, 4], head_len=20)
    p = planner()
    p.queue([leader, twin])
    take(p)
    assert p.forget(twin) == []
    assert p.head_done(tuple(head)) == []


def test_reset_forgets_everything() -> None:
    p = planner(group=1)
    p.queue([Row(1, [1] * 10), Row(2, [2] * 10)])
    (rid, _), = take(p)
    p.started(rid, 10)
    p.reset()
    assert p.queued == 0
    p.queue([Row(3, [3] * 10)])
    assert [r for r, _ in take(p)] == [3]  # nothing in flight holds it back


def test_rows_admitted_together_share_their_head_where_a_store_keeps_it() -> None:
    shared = list(range(100, 120))
    with_store = planner()
    rows = [Row(1, [*shared, 1, 2]), Row(2, [*shared, 3, 4])]
    with_store.queue(rows)
    assert [r.head_len for r in rows] == [20, 20]
    assert take(with_store) == [(1, [shared, [1, 2]])]  # the twin waits for the head
    # Twins released by their head are not grouped again; without a store none are.
    released = [Row(3, [*shared, 5]), Row(4, [*shared, 6])]
    with_store.queue(released, joining=True)
    without = planner(reuse=False)
    alone = [Row(5, [*shared, 7]), Row(6, [*shared, 8])]
    without.queue(alone)
    assert [r.head_len for r in released + alone] == [0, 0, 0, 0]


def test_a_group_never_outgrows_the_batch() -> None:
    assert PrefillPlanner[Row].for_batch(4, 8, 32, head_min_tokens=None).group_size == 4
    assert PrefillPlanner[Row].for_batch(16, 8, 32, head_min_tokens=16).group_size == 8
