"""The declared vision families: docs/models.md's table is written from them, every family
has a reason where it is not served, and a served family has a format."""

from __future__ import annotations

from engine.requests.inbound.vision_families import FAMILIES, Support, images_refused_because
from engine.requests.inbound.vision_formats import AUDIO_FAMILIES, FORMATS
from testkit.vision_zoo_docs import DOCS, written


def test_docs_models_vision_table_is_generated_from_the_families() -> None:
    text = DOCS.read_text()
    assert written(text) == text, ("docs/models.md's vision table is out of date: run "
                                   "python -m testkit.vision_zoo_docs")


def test_a_family_is_served_exactly_when_it_has_a_format_and_says_why_not() -> None:
    for family in FAMILIES:
        served = family.support is Support.IMAGES
        assert served == all(t in FORMATS for t in family.model_types), family.name
        assert (family.reason is None) == served, family.name
        if not served:
            assert images_refused_because(family.model_types[0]) == family.reason


def test_a_family_says_it_reads_audio_exactly_when_its_format_does() -> None:
    for family in FAMILIES:
        assert family.audio == bool(AUDIO_FAMILIES & set(family.model_types)), family.name
    assert any(family.audio for family in FAMILIES)


def test_an_unknown_family_is_told_which_are_served() -> None:
    reason = images_refused_because("no_such_vlm")
    assert "Qwen3-VL" in reason and "send text only" in reason
