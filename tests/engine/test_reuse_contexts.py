"""Prefix reuse across rows whose KV differs by more than their tokens: an image row on a grid
of positions (Qwen2-VL's M-RoPE, whose cache is kept shifted) and a text row, both with the
same LoRA adapter and a long shared system prompt. Each must answer as on a fresh engine,
whichever ran first: the reuse key composes the shift and the adapter (``reuse_key``)
instead of one tag overwriting the other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, SamplingParams
from testkit.adapters import make_adapter
from tests.conftest import _built, _cache_root, _vision_stack, greedy
from tests.engine.test_vision import BLUE, image_part

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _vision_stack()
    from testkit.vision_model import build_tiny_qwen2_vl

    return _built(_cache_root(tmp_path_factory) / "tiny-qwen2_vl-v1", build_tiny_qwen2_vl)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, qwen2_vl_dir: Path) -> str:
    out = tmp_path_factory.mktemp("qwen-adapter") / "a"
    return str(make_adapter(out, qwen2_vl_dir, seed=5, rank=4))


SYSTEM = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(60))}


def image_turn() -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": [image_part(BLUE), {"type": "text",
                                                                    "text": "What is it?"}]}]


def text_turn() -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": "Name a colour."}]


def answer(eng: Engine, messages: list[dict[str, Any]], params: SamplingParams,
           ) -> tuple[int, ...]:
    return eng.submit(ChatRequest.from_openai(messages, params)).result(timeout=120).token_ids


@pytest.mark.parametrize("order", ["image_first", "text_first"])
def test_shifted_image_rows_and_text_rows_of_one_adapter_never_share_kv(
        make_engine: Callable[..., Engine], qwen2_vl_dir: Path, adapter_dir: str,
        order: str) -> None:
    params = greedy(12, adapter=adapter_dir)
    turns = {"image": image_turn(), "text": text_turn()}
    fresh = {name: answer(make_engine(qwen2_vl_dir, prefix_cache_bytes=0), messages, params)
             for name, messages in turns.items()}
    eng = make_engine(qwen2_vl_dir, max_batch=8)
    prompt = eng._runtime.preparer().prepare(ChatRequest.from_openai(turns["text"], params))
    assert len(prompt.prompt_ids) > 300  # a head long enough to be stored and offered
    names = ["image", "text"] if order == "image_first" else ["text", "image"]
    for name in names:
        assert answer(eng, turns[name], params) == fresh[name], name
    # Each again resumes its own kind's stored prompt, and still answers the same.
    before = eng.stats().prefix_hits
    for name in names:
        assert answer(eng, turns[name], params) == fresh[name], name
    assert eng.stats().prefix_hits >= before + 2


def test_the_disk_tier_keeps_each_context_apart(make_engine: Callable[..., Engine],
                                                qwen2_vl_dir: Path, adapter_dir: str,
                                                tmp_path: Path) -> None:
    """Prefixes written by one engine and read back by the next: an adapter's text row, its
    shifted image row and the base model's text row each resume only their own."""
    base, tuned = greedy(12), greedy(12, adapter=adapter_dir)
    runs = [(text_turn(), base), (text_turn(), tuned), (image_turn(), tuned)]
    fresh = [answer(make_engine(qwen2_vl_dir, prefix_cache_bytes=0), m, p) for m, p in runs]
    disk = {"prefix_cache_dir": str(tmp_path / "prefixes"), "max_batch": 8}
    writer = make_engine(qwen2_vl_dir, **disk)
    assert [answer(writer, m, p) for m, p in runs] == fresh
    writer.close()  # its stored prefixes are written out
    reader = make_engine(qwen2_vl_dir, **disk)
    assert [answer(reader, m, p) for m, p in reversed(runs)] == fresh[::-1]
    assert reader.stats().prefix_disk_hits >= 3
