"""Gemma 4's image rows prefill what mlx-vlm's own generation prefills: the row's cache, chunk
by chunk, holds the keys and values mlx-vlm's language model writes for the whole prompt
with its processor's token types: an image's tokens attending to each other both ways
(``use_bidirectional_attention: "vision"``) and reading token 0's per-layer inputs. A
causal prefill, or one with the image tokens' own per-layer inputs, would not (on the tiny
model few greedy tokens tell them apart, so the caches are compared).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine import ChatRequest, Engine
from engine.requests.inbound.prompts import PromptImage
from tests.conftest import greedy
from tests.engine.test_vision import BLUE, RED, asking, image_part, vlm_engine

pytestmark = pytest.mark.timeout(600)


def _engine_cache(path: Path, prompt: list[int], images: tuple[PromptImage, ...],
                  chunk: int) -> tuple[list[Any], int]:
    """The row's cache as the engine's image prefill writes it, ``chunk`` tokens a step
    (an image's tokens in one), and where it ends."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.device.vision.tower import VisionTower
    from engine.requests.inbound.vision_formats import vision_format

    model, tokenizer = load(str(path))[:2]
    config = json.loads((path / "config.json").read_text())
    fmt = vision_format(config, tokenizer, path)
    assert fmt is not None
    tower = VisionTower(path, model, fmt, mx.default_stream(mx.default_device()), 1 << 20)
    features = {}
    for image in images:
        run = tower.start(image)
        while (found := run.step()) is None:
            pass
        features[image.key] = found
    cache = make_prompt_cache(model)
    end = max(i.start + i.length for i in images)
    done, chunks = 0, []
    while done < end:
        stop = tower.chunk_end(images, min(done + chunk, end))
        tower.prefill(cache, prompt[done:stop], tower.embeddings(prompt, done, stop, images,
                                                                 features), None)
        chunks.append((done, stop))
        done = stop
    for image in images:  # no chunk cut an image
        assert any(a <= image.start and image.start + image.length <= b for a, b in chunks)
    return cache, end


def _library_cache(path: Path, prompt: list[int], pixels: list[np.ndarray],
                   both_ways: bool = True, zero_images: bool = True) -> list[Any]:
    """mlx-vlm's cache for ``prompt`` prefilled whole, as its generation does with its
    processor's token types (``both_ways``) and per-layer inputs (``zero_images``: token
    0's at the image tokens, as ``get_input_embeddings`` gives)."""
    from mlx_vlm.utils import load_model

    model = load_model(path)
    ids = mx.array([prompt])
    values = (mx.array(np.concatenate(pixels)) if len({p.shape for p in pixels}) == 1
              else [mx.array(p[0]) for p in pixels])
    out = model.get_input_embeddings(ids, values)
    per_layer = out.per_layer_inputs
    if not zero_images:
        per_layer = model.language_model.model.get_per_layer_inputs(ids)
    types = mx.array((np.array(prompt) == model.config.image_token_id).astype(np.int32)[None])
    cache = model.language_model.make_cache()
    model.language_model(ids, inputs_embeds=out.inputs_embeds, cache=cache,
                         per_layer_inputs=per_layer,
                         **({"mm_token_type_ids": types} if both_ways else {}))
    mx.eval([c.state for c in cache])
    return cache


def _gap(ours: list[Any], theirs: list[Any], end: int) -> float:
    """The largest difference between two caches' keys and values over ``prompt[:end]``."""
    gap = 0.0
    for a, b in zip(ours, theirs, strict=False):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            gap = max(gap, float(mx.abs(x[..., :end, :] - y[..., :end, :]).max()))
    return gap


@pytest.mark.parametrize("chunk", [3, 64])
def test_gemma4_rows_prefill_images_both_ways_as_the_vision_library(
        make_engine: Callable[..., Engine], family_dirs: Callable[[str], Path],
        chunk: int) -> None:
    path = family_dirs("gemma4")
    assert json.loads((path / "config.json").read_text())["text_config"][
        "use_bidirectional_attention"] == "vision"
    eng = vlm_engine(make_engine, path)
    messages = asking(image_part(RED, size=(100, 30)), image_part(BLUE, seed=1),
                      text="Compare them.")
    prepared = eng._runtime.preparer().prepare(ChatRequest.from_openai(messages, greedy(4)))
    prompt, images = list(prepared.prompt_ids), prepared.images
    ours, end = _engine_cache(path, prompt, images, chunk)
    pixels = [i.read_pixels() for i in images]
    gap = _gap(ours, _library_cache(path, prompt[:end], pixels), end)
    # Prefilled in one chunk, the same arithmetic: equal. In chunks of three (an image's
    # tokens in one), within rounding.
    assert gap == 0.0 if chunk >= end else gap < 2e-5
    # What is compared tells the ways apart: a causal prefill (the tiny model's two-way
    # attention moves its second layer's keys and values by about 1e-4), or the image
    # tokens' own per-layer inputs (by about 3), writes other keys and values.
    assert _gap(ours, _library_cache(path, prompt[:end], pixels, both_ways=False), end) > 5e-5
    assert _gap(ours, _library_cache(path, prompt[:end], pixels, zero_images=False),
                end) > 1.0
