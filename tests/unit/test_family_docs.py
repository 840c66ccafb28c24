"""docs/models.md agrees with the family catalog (no model, no assets).

The family tables are generated from ``testkit/families/catalog.py``
(``python -m testkit.families.docs_tables`` rewrites them): a family added or changed in
the catalog without regenerating them fails here. The dialect table is written by hand, a
row per dialect naming its families: each family's title must be in exactly one row, the
row of the dialect the catalog expects it to speak.
"""

from __future__ import annotations

import re

from engine.requests.dialects.dialect import Dialect
from engine.requests.dialects.registry import FAMILIES as DIALECTS
from testkit.families import FAMILIES
from testkit.families.docs_tables import DOCS, generated_block, render

DIALECT_SECTION = "## Each family's own tool and reasoning syntax"
# A dialect row's first cell: the families' titles, then the dialect's name in backticks.
_FIRST_CELL = re.compile(r"^\| (?P<titles>[^|(]+?) \(`(?P<dialect>[^`]+)`")


def test_the_family_tables_are_generated_from_the_catalog() -> None:
    block = generated_block(DOCS.read_text(encoding="utf-8"))
    assert block, f"{DOCS} has lost the markers of its generated family tables"
    assert block == render(), ("docs/models.md's family tables differ from the catalog: "
                               "run python -m testkit.families.docs_tables")


def _dialect_rows() -> list[tuple[list[str], str]]:
    """(titles, dialect name) of each row of the dialect table."""
    section = DOCS.read_text(encoding="utf-8").split(DIALECT_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        found = _FIRST_CELL.match(line)
        if found:
            rows.append(([t.strip() for t in found["titles"].split(",")], found["dialect"]))
    return rows


def test_every_family_has_its_row_in_the_dialect_table() -> None:
    rows = _dialect_rows()
    names = {Dialect.name, *(dialect.name for dialect in DIALECTS)}
    assert rows and all(dialect in names for _, dialect in rows), rows
    for family in FAMILIES.values():
        holding = [dialect for titles, dialect in rows if family.title in titles]
        assert holding == [family.expected.dialect], (
            f"{family.name} ({family.title!r}) must be named in exactly one row of "
            f"docs/models.md's dialect table, the {family.expected.dialect!r} row; "
            f"found in {holding}")
