"""Prompt-lookup drafts and the acceptance record that gates speculation (no model)."""

from __future__ import annotations

import pytest

from engine.core.drafts import Acceptance, ShadowDraft, lookup_draft


def test_the_draft_is_what_followed_the_latest_match_of_the_tail() -> None:
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    # The tail [1, 2, 3] last appeared at 6, followed by 5, 6, 7.
    assert lookup_draft(tokens, 3) == [5, 6, 7]
    # Running into the end, the copy continues the repeating pattern.
    assert lookup_draft(tokens, 10) == [5, 6, 7, 1, 2, 3, 5, 6, 7, 1]


def test_the_longest_matching_tail_wins() -> None:
    tokens = [7, 8, 1, 50, 60, 8, 1, 70, 7, 8, 1]
    # [7, 8, 1] matches at 0 (followed by 50), [8, 1] alone would match later (70).
    assert lookup_draft(tokens, 2) == [50, 60]


def test_no_draft_without_a_match_of_min_ngram() -> None:
    assert lookup_draft([1, 2, 3, 4, 5], 4) == []
    assert lookup_draft([1, 2, 1, 3], 4) == []  # only a single-token match
    assert lookup_draft([1, 2, 1], 4, min_ngram=1) == [2, 1, 2, 1]
    assert lookup_draft([], 4) == [] and lookup_draft([5], 4) == []
    assert lookup_draft([1, 2, 1, 2], 0) == []


@pytest.mark.parametrize("length", [1, 2, 5])
def test_drafts_never_exceed_their_length(length: int) -> None:
    tokens = [3, 4] * 10
    draft = lookup_draft(tokens, length)
    assert len(draft) == length and draft == ([3, 4] * 5)[:length]


def test_acceptance_is_a_running_mean_that_starts_at_zero() -> None:
    record = Acceptance(weight=0.5)
    assert record.mean == 0.0
    record.record(4)
    assert record.mean == 2.0
    record.record(0)
    assert record.mean == 1.0 and record.drafts == 2 and record.accepted == 4


def test_a_shadow_records_how_much_of_each_draft_came_true() -> None:
    shadow = ShadowDraft(length=3)
    tokens = [5, 6, 7, 8, 5, 6]
    assert shadow.observe(tokens) and shadow.draft == [7, 8, 5]
    for token in (7, 8, 9):  # two right, then a miss
        tokens.append(token)
        shadow.observe(tokens)
    assert shadow.acceptance.drafts == 1 and shadow.acceptance.accepted == 2
    shadow.reset()
    assert shadow.draft == []


def test_a_shadow_without_a_match_has_no_draft() -> None:
    shadow = ShadowDraft(length=4)
    assert not shadow.observe([1, 2, 3, 4])
    assert shadow.acceptance.drafts == 0
