"""The family catalog is whole: what each row expects names real dialects, every dialect of
the engine has a family in it, fitted at least once, and every family has a title (no
model, no assets)."""

from __future__ import annotations

from engine.requests.dialects.dialect import Dialect
from engine.requests.dialects.registry import FAMILIES as DIALECTS
from testkit.families import FAMILIES
from testkit.families.catalog import one_per_dialect


def test_each_family_expects_a_dialect_the_engine_has() -> None:
    names = {Dialect.name, *(dialect.name for dialect in DIALECTS)}
    unknown = {f.name: f.expected.dialect for f in FAMILIES.values()
               if f.expected.dialect not in names}
    assert not unknown, f"no such dialect: {unknown}"


def test_every_dialect_has_a_family_and_a_fitted_one() -> None:
    dialects = {Dialect.name, *(dialect.name for dialect in DIALECTS)}
    covered = {f.expected.dialect for f in FAMILIES.values()}
    fitted = {f.expected.dialect for f in FAMILIES.values() if f.expected.fitted}
    assert dialects == covered, f"no family of the catalog speaks {sorted(dialects - covered)}"
    assert covered == fitted, f"no fitted family speaks {sorted(covered - fitted)}"


def test_one_family_per_dialect_is_the_first_of_each() -> None:
    sample = one_per_dialect()
    assert len(sample) == len({f.expected.dialect for f in FAMILIES.values()})
    assert sample[0] == next(iter(FAMILIES))


def test_every_family_has_its_own_title() -> None:
    titles = [f.title for f in FAMILIES.values()]
    assert all(titles) and len(set(titles)) == len(titles), titles
