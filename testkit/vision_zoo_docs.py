"""docs/models.md's vision table, written from the declared families
(``engine.requests.inbound.vision_families``), which the vision zoo proves.

``python -m testkit.vision_zoo_docs`` rewrites the table between its markers;
``tests/unit/test_vision_families.py`` fails when the file and the table differ.
"""

from __future__ import annotations

from pathlib import Path

from engine.requests.inbound.vision_families import FAMILIES, Support

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
START, END = "<!-- vision-zoo:start -->", "<!-- vision-zoo:end -->"


def render() -> str:
    """The table: each family, its model types, what it gets, and why not more."""
    mark = {Support.IMAGES: "images and text", Support.TEXT: "text; images refused",
            Support.NONE: "not loaded"}
    lines = [START,
             "Generated from `engine/requests/inbound/vision_families.py` by `python -m "
             "testkit.vision_zoo_docs`; the vision zoo (`tests/engine/test_vision_zoo.py`) "
             "loads a tiny checkpoint of each family and holds the engine to its row.",
             "",
             "| family | `model_type` | served | why not more |",
             "|---|---|---|---|"]
    for family in FAMILIES:
        types = ", ".join(f"`{t}`" for t in family.model_types)
        why = (family.reason or "").replace("|", "\\|")
        served = mark[family.support] + ("; audio where the checkpoint has an audio tower"
                                         if family.audio else "")
        lines.append(f"| {family.name} | {types} | {served} | {why} |")
    lines.append(END)
    return "\n".join(lines)


def written(text: str) -> str:
    """``text`` (docs/models.md) with its table replaced by ``render()``."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


if __name__ == "__main__":
    DOCS.write_text(written(DOCS.read_text()))
