"""An image row with a LoRA adapter, on the tiny Qwen2-VL (image tokens on a grid of
positions): its image prefill runs through mlx-vlm's language model (``VisionTower.prefill``),
which holds the text model's layers (``RowAdapters.mirror``), so it adds the row's adapter
there too. Its tokens equal mlx-vlm's own generation on a copy of the checkpoint with the
adapter fused in, and differ from the same image row without it, whether the adapter loaded
before the tower was built or after, alone or batched with other rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, SamplingParams
from testkit.adapters import fused_checkpoint, make_adapter
from testkit.vision_model import vision_library_tokens
from tests.engine.test_vision import BLUE, RED, asking, image_part, tokens

pytestmark = pytest.mark.timeout(600)

TOKENS = 12


def greedy(adapter: Path | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0,
                          adapter=None if adapter is None else str(adapter))


def library_tokens(eng: Engine, model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    """mlx-vlm's greedy tokens for the same prompt ids and pixels, on ``model_dir``."""
    prepared = eng._runtime.preparer().prepare(ChatRequest.from_openai(messages, greedy()))
    return vision_library_tokens(model_dir, prepared.prompt_ids,
                                 [i.read_pixels() for i in prepared.images], TOKENS,
                                 [dict(i.extra) for i in prepared.images])


@pytest.mark.parametrize("family_vlm_dir", ["qwen2_vl"], indirect=True)
def test_an_image_row_prefills_with_its_adapter(make_engine: Callable[..., Engine],
                                                family_vlm_dir: Path, tmp_path: Path) -> None:
    model_dir = family_vlm_dir
    # A on attention, B on the MLP: B's layers are first wrapped after the tower is built.
    first = make_adapter(tmp_path / "A", model_dir, seed=21)
    later = make_adapter(tmp_path / "B", model_dir, seed=22, rank=4,
                         keys=("mlp.up_proj", "mlp.down_proj"))
    red, blue = asking(image_part(RED)), asking(image_part(BLUE, seed=1), text="And this?")
    eng = make_engine(model_dir, max_batch=8, prefill_chunk=8, prefix_cache_bytes=0)
    # The first image row holds A: the tower is built with A's layers wrapped already.
    alone: dict[tuple[str, str | None], tuple[int, ...]] = {
        ("red", "A"): tokens(eng, red, greedy(first))}
    for image, messages in (("red", red), ("blue", blue)):
        alone[(image, None)] = tokens(eng, messages, greedy())
        alone[(image, "B")] = tokens(eng, messages, greedy(later))
    alone[("blue", "A")] = tokens(eng, blue, greedy(first))
    for image, messages in (("red", red), ("blue", blue)):
        base = library_tokens(eng, model_dir, messages)
        assert list(alone[(image, None)]) == base
        for name, adapter in (("A", first), ("B", later)):
            fused = fused_checkpoint(model_dir, adapter, tmp_path / f"fused-{name}")
            assert list(alone[(image, name)]) == library_tokens(eng, fused, messages)
            assert alone[(image, name)] != alone[(image, None)]
    # Batched: image rows of each adapter and none, beside each other, as alone.
    cases = [(image, name) for image in ("red", "blue") for name in ("A", None, "B")]
    paths: dict[str | None, Path | None] = {"A": first, "B": later, None: None}
    handles = [eng.submit(ChatRequest.from_openai(red if image == "red" else blue,
                                                  greedy(paths[name])))
               for image, name in cases]
    assert [h.result(timeout=120).token_ids for h in handles] == [alone[c] for c in cases]
