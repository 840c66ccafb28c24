"""docs/compatibility.md, written from the compatibility table (``engine.compatibility``).

``python -m testkit.compatibility_docs`` writes it; ``tests/unit/test_compatibility.py``
fails when the file and the table differ.
"""

from __future__ import annotations

from pathlib import Path

from engine.compatibility import Feature, Status, pairs, verdict

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"


def render() -> str:
    """docs/compatibility.md: the features, the grid, and every pair that is not plainly
    served, with its reason."""
    features = list(Feature)
    mark = {Status.SERVED: "✓", Status.INERT: "○", Status.REFUSED: "✗", Status.EXCLUSIVE: "≠"}
    lines = [
        "# Compatibility: every feature with every other",
        "",
        "Generated from `engine/compatibility.py` by `python -m "
        "testkit.compatibility_docs`; `tests/unit/test_compatibility.py` fails when this file is "
        "out of date, and the matrix tests (`tests/engine/test_crossings.py`, "
        "`tests/distributed/test_sharded_crossings.py`) run every pair.",
        "",
        "✓ served exactly: a row with both equals the same row run alone, and the row with "
        "one feature where the other changes no token. ○ served exactly, but one of the two "
        "does nothing for that row (why below). ✗ refused at `submit` with "
        "`UnsupportedCombinationError`, naming both (why below; two engine settings are "
        "refused by `EngineConfig`, a `ValueError` naming both). ≠ alternatives: a request "
        "has one or the other.",
        "",
        "## Features",
        "",
        "| # | feature | kind |",
        "|---|---|---|",
        *(f"| {i} | `{f.value}`: {f.title} | {f.kind.value} |"
          for i, f in enumerate(features, 1)),
        "",
        "## The grid",
        "",
        "| | " + " | ".join(str(i) for i in range(1, len(features) + 1)) + " |",
        "|---" * (len(features) + 1) + "|",
    ]
    for i, a in enumerate(features, 1):
        cells = ["·" if a is b else mark[verdict(a, b).status] for b in features]
        lines.append(f"| **{i}** `{a.value}` | " + " | ".join(cells) + " |")
    lines += ["", "## Refused", "", "| pair | why |", "|---|---|"]
    lines += [f"| `{a.value}` + `{b.value}` | {v.reason} |" for a, b, v in pairs()
              if v.status is Status.REFUSED]
    lines += ["", "## Served, one feature inert", "", "| pair | inert | why |", "|---|---|---|"]
    lines += [f"| `{a.value}` + `{b.value}` | `{v.inert.value if v.inert else ''}` | "
              f"{v.reason} |" for a, b, v in pairs() if v.status is Status.INERT]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    DOCS.write_text(render(), encoding="utf-8")
