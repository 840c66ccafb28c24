"""engine.compatibility: the table, its refusals at submit, and the docs written from it."""

from __future__ import annotations

from itertools import combinations

import pytest

from engine import ChatRequest, SamplingParams, TextRequest, UnsupportedCombinationError
from engine.compatibility import (
    Feature,
    Kind,
    Status,
    check_combination,
    pairs,
    refusal,
    verdict,
)
from testkit.compatibility_docs import DOCS, render

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4"
       "z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg==")


def test_the_docs_are_the_table() -> None:
    assert DOCS.read_text(encoding="utf-8") == render(), (
        "docs/compatibility.md is out of date: run python -m testkit.compatibility_docs")


def test_every_pair_has_one_verdict_and_every_refusal_or_inert_pair_a_reason() -> None:
    listed = pairs()
    assert len(listed) == len(list(combinations(Feature, 2)))
    for a, b, found in listed:
        assert verdict(b, a) == found
        if found.status in (Status.REFUSED, Status.INERT):
            assert found.reason, f"{a.value}+{b.value} has no reason"
        if found.status is Status.INERT:
            assert found.inert in (a, b)


def test_every_feature_has_a_kind_and_a_title() -> None:
    for feature in Feature:
        assert isinstance(feature.kind, Kind) and feature.title


def test_refusal_names_the_first_refused_pair_only_when_one_is_there() -> None:
    assert refusal([Feature.IMAGES, Feature.ADAPTER, Feature.LOGPROBS]) is None
    found = refusal([Feature.LOGPROBS, Feature.SHARDED_TENSOR, Feature.ADAPTER])
    assert found is not None and {found[0], found[1]} == {Feature.ADAPTER,
                                                          Feature.SHARDED_TENSOR}


def _image_request(adapter: str | None = None) -> ChatRequest:
    return ChatRequest.from_openai(
        [{"role": "user", "content": "hi"},
         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}},
                                      {"type": "text", "text": "what is it?"}]}],
        SamplingParams(max_tokens=4, adapter=adapter))


@pytest.mark.parametrize("shard", ["tensor", "pipeline"])
def test_a_sharded_engine_refuses_images_adapters_and_keep_alive_by_name(shard: str) -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        check_combination(_image_request(), shard, keep_alive=False)
    assert refused.value.features == ("images", f"sharded_{shard}")
    assert refused.value.field == "messages[1].content"
    assert "images" in str(refused.value) and f"sharded_{shard}" in str(refused.value)
    with pytest.raises(UnsupportedCombinationError) as refused:
        check_combination(TextRequest("x", SamplingParams(adapter="/a")), shard, False)
    assert refused.value.field == "adapter"
    with pytest.raises(UnsupportedCombinationError) as refused:
        check_combination(TextRequest("x"), shard, keep_alive=True)
    assert refused.value.field == "keep_alive"
    assert isinstance(refused.value, ValueError)  # callers catching bad input still catch it


def test_an_unsharded_engine_refuses_none_of_them() -> None:
    check_combination(_image_request(adapter="/a"), None, keep_alive=True)
