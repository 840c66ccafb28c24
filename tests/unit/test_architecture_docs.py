"""docs/architecture.md names every module of the engine and the faces, each under its own
folder, so the layout it draws cannot drift from the code (the family docs test does the
same for families)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("engine", "mlx_providers")


def _tree() -> list[str]:
    """The doc's layout block, line by line."""
    text = DOC.read_text()
    return text.split("```", 2)[1].splitlines()


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """Each folder heading's path (``engine/device/lane``) -> its own lines: from the heading
    to the next heading as shallow or shallower, less its sub-folders' sections."""
    headings: list[tuple[int, int, str]] = []  # line, indent, name
    for index, line in enumerate(lines):
        found = re.match(r"( *)([\w.]+)/(\s|$)", line)
        if found:
            headings.append((index, len(found.group(1)), found.group(2)))
    spans: dict[str, range] = {}
    stack: list[tuple[int, str]] = []
    for position, (index, indent, name) in enumerate(headings):
        stack = [(i, n) for i, n in stack if i < indent]
        stack.append((indent, name))
        end = next((j for j, depth, _ in headings[position + 1:] if depth <= indent),
                   len(lines))
        spans["/".join(n for _, n in stack)] = range(index, end)
    sections = {}
    for path, span in spans.items():
        nested = {i for other, inner in spans.items() if other.startswith(f"{path}/")
                  for i in inner}
        sections[path] = [lines[i] for i in span if i not in nested]
    return sections


MODULES = sorted(p.relative_to(ROOT) for package in PACKAGES
                 for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py")


def test_the_layout_block_is_read() -> None:
    sections = _sections(_tree())
    assert {"engine", "engine/device/lane", "mlx_providers/server"} <= set(sections)
    assert len(MODULES) > 150


@pytest.mark.parametrize("module", MODULES, ids=str)
def test_every_module_is_named_under_its_folder(module: Path) -> None:
    sections = _sections(_tree())
    folder = module.parent.as_posix()
    assert folder in sections, f"docs/architecture.md draws no {folder}/ folder"
    named = re.compile(rf"(?<![\w/]){re.escape(module.name)}\b")
    assert any(named.search(line) for line in sections[folder]), (
        f"docs/architecture.md does not name {module} under {folder}/")


PATH_MENTION = re.compile(r"\b((?:engine|mlx_providers|tests|testkit|bench|examples|native)"
                          r"/[\w/]+\.(?:py|md|cpp|h))\b")
WRITTEN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", WRITTEN, ids=lambda p: p.name)
def test_every_file_the_docs_point_at_exists(doc: Path) -> None:
    """A path the README or a doc names (``engine/core/step_costs.py``, a test) is there:
    a move updates the prose that points at it."""
    gone = sorted({m for m in PATH_MENTION.findall(doc.read_text())
                   if not (ROOT / m).exists()})
    assert gone == [], f"{doc.name} points at files that are not there: {gone}"
