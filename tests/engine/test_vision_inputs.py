"""An image's way into the prompt, per family, against mlx-vlm's own processor: the prompt ids
the engine builds equal the processor's for the image before and after the text, and the
tower reads the processor's pixel values; sizes
follow each family's resize rules; an image too long and thin for a family is refused by
part, and one the family reads equals mlx-vlm's own generation.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import ChatRequest, Engine, InvalidRequestError
from testkit.vision_model import vision_library_tokens
from tests.conftest import greedy, prompts_of_lengths, request_for
from tests.engine.test_vision import BLUE, RED, asking, image_part, vlm_engine

pytestmark = pytest.mark.timeout(600)

# What each family's own chat template writes for an image part, which its processor
# expands into the image's block.
PLACEHOLDERS = {"gemma3": "<start_of_image>", "mistral3": "[IMG]",
                "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "lfm2-vl": "<image>", "llava": "<image>",
                "smolvlm": "<image>", "idefics3": "<image>", "internvl_chat": "<image>",
                "gemma4": "<|image|>", "llama4": "<|image|>",
                **dict.fromkeys(("qwen3_vl", "qwen3_5", "qwen3_5_moe"),
                                "<|vision_start|><|image_pad|><|vision_end|>")}


def processed(model_dir: Path, messages: list[dict[str, Any]],
              images: list[dict[str, Any]]) -> tuple[list[int], np.ndarray]:
    """mlx-vlm's prompt ids and pixel values: the chat template's text with the family's
    placeholder for each image, expanded and tokenized by the family's processor
    (``load_processor``), which also reads the images."""
    from PIL import Image

    family = json.loads((model_dir / "config.json").read_text())["model_type"]
    importlib.import_module(f"mlx_vlm.models.{family.replace('-', '_')}")  # its processor
    from mlx_vlm.utils import load_processor

    processor = load_processor(model_dir, add_detokenizer=False)
    rendered = [{"role": m["role"], "content": "".join(
        PLACEHOLDERS[family] if part["type"] == "image_url" else part["text"]
        for part in m["content"])} for m in messages]
    text = processor.tokenizer.apply_chat_template(rendered, tokenize=False,
                                                   add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(base64.b64decode(
        part["image_url"]["url"].split(",", 1)[1]))).convert("RGB") for part in images]
    out = processor(text=[text], images=pictures)
    values = out["pixel_values"]
    if isinstance(values, list):  # images of several sizes (Gemma 4's): one array each
        values = np.stack([np.array(v) for v in values[:1]])
    return [int(t) for t in out["input_ids"].tolist()[0]], np.array(values)


def llama4_global_view(model_dir: Path, part: dict[str, Any]) -> np.ndarray:
    """mlx-vlm's Llama 4 processor's pixels for ``part``'s image read as one tile."""
    from PIL import Image

    importlib.import_module("mlx_vlm.models.llama4")
    from mlx_vlm.utils import load_processor

    processor = load_processor(model_dir, add_detokenizer=False).image_processor
    picture = Image.open(io.BytesIO(base64.b64decode(
        part["image_url"]["url"].split(",", 1)[1]))).convert("RGB")
    return np.asarray(processor._preprocess_single(
        processor._split_into_tiles(picture, (1, 1))[0]))


@pytest.mark.parametrize("order", ["image first", "image last", "two images"])
def test_prompt_ids_equal_the_vision_library_processors(
        make_engine: Callable[..., Engine], family_vlm_dir: Path, order: str) -> None:
    eng = vlm_engine(make_engine, family_vlm_dir)
    wide, tall = image_part(RED, size=(100, 30)), image_part(BLUE, seed=1, size=(30, 70))
    question = {"type": "text", "text": "What is it?"}
    content = {"image first": [wide, question], "image last": [question, wide],
               "two images": [wide, question, tall]}[order]
    messages = [{"role": "user", "content": content}]
    prepared = eng._runtime.preparer().prepare(ChatRequest.from_openai(messages, greedy(4)))
    images = [part for part in content if part["type"] == "image_url"]
    ids, pixels = processed(family_vlm_dir, messages, images)
    assert prepared.prompt_ids == ids
    if len(images) == 1:  # the tower reads the processor's own pixel values
        ours = prepared.images[0].read_pixels()
        if len(ours) == len(pixels) + 1 and "llama4" in family_vlm_dir.name:
            # Llama 4's tiles, then the global view its prompt holds and mlx-vlm's processor
            # gives no pixels for: the processor's own view of the image as one tile.
            ours, view = ours[:-1], ours[-1]
            np.testing.assert_allclose(view, llama4_global_view(family_vlm_dir, wide),
                                       atol=1e-5)
        np.testing.assert_allclose(ours, pixels, atol=1e-5)


# The tiny models' refusals (``testkit.vision_model``): Qwen-VL's processors read aspect
# ratios under 200 only; LFM2-VL's view of a 9 px side (raised to 32 px, the other side
# kept in ratio) takes more patches than its tower's padded view (64 here).
REFUSED = {("qwen2_vl", (2000, 9)): "aspect ratios under 200",
           ("qwen2_vl", (9, 2000)): "aspect ratios under 200",
           ("qwen2_5_vl", (2000, 9)): "aspect ratios under 200",
           ("qwen2_5_vl", (9, 2000)): "aspect ratios under 200",
           ("lfm2-vl", (2000, 9)): "patches, over the 64 its tower reads",
           ("lfm2-vl", (9, 2000)): "patches, over the 64 its tower reads",
           **{(family, size): "aspect ratios under 200"
              for family in ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
              for size in ((2000, 9), (9, 2000))}}


@pytest.mark.parametrize("size", [(2000, 9), (9, 2000), (1, 1)])
def test_extreme_aspect_ratios_are_read_as_the_library_or_refused_by_part(
        make_engine: Callable[..., Engine], family_vlm_dir: Path,
        size: tuple[int, int]) -> None:
    family = json.loads((family_vlm_dir / "config.json").read_text())["model_type"]
    eng = vlm_engine(make_engine, family_vlm_dir)
    params = greedy(8)
    text = prompts_of_lengths(eng, [24], seed=6)[0]
    alone = eng.submit(request_for(text, params)).result(timeout=60).token_ids
    messages = asking(image_part(RED, size=size))
    beside, image = (eng.submit(request_for(text, params)),
                     eng.submit(ChatRequest.from_openai(messages, params)))
    refusal = REFUSED.get((family, size))
    if refusal is not None:
        with pytest.raises(InvalidRequestError, match=refusal) as raised:
            image.result(timeout=120)
        assert raised.value.field == "messages[0].content[0]"
        assert str(raised.value).startswith(f"messages[0].content[0]: an image of "
                                            f"{size[0]}x{size[1]} px is too long and thin")
    else:
        ours = image.result(timeout=120).token_ids
        prepared = eng._runtime.preparer().prepare(ChatRequest.from_openai(messages, params))
        (read,) = prepared.images
        assert list(ours) == vision_library_tokens(
            family_vlm_dir, prepared.prompt_ids, [read.read_pixels()], 8, [dict(read.extra)])
    assert beside.result(timeout=60).token_ids == alone  # the text row beside it: unmoved


SIDES = [1, 2, 9, 13, 14, 15, 27, 28, 29, 41, 42, 56, 99, 300, 1000, 2000, 5000]


def test_sizes_follow_the_vision_librarys_own_resize_rules() -> None:
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import _is_image_too_large, _smart_resize
    from mlx_vlm.models.llama4.processing_llama4 import Llama4ImageProcessor
    from mlx_vlm.models.pixtral.image_processing_pixtral import get_resize_output_image_size
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import _smart_resize_image
    from transformers.image_transforms import get_resize_output_image_size as get_output_size
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        get_resize_output_image_size as idefics3_size,
    )

    from engine.requests.inbound.gemma4_format import gemma4_size
    from engine.requests.inbound.idefics3_format import longest_edge_size
    from engine.requests.inbound.images import DecodedImage
    from engine.requests.inbound.llama4_format import best_grid
    from engine.requests.inbound.llava_format import LlavaFormat
    from engine.requests.inbound.vision_formats import (
        Lfm2VlFormat,
        Mistral3Format,
        smart_resize,
    )

    mistral = Mistral3Format("mistral3", 10, 12, 13, 1024, 28, (0.5,) * 3, (0.5,) * 3)
    lfm2 = Lfm2VlFormat("lfm2-vl", 396, 1, 2, 3, {})
    llava = LlavaFormat("llava", 32000, 336, None, (336, 336), 14, 0, (0.5,) * 3, (0.5,) * 3)
    llama4 = Llama4ImageProcessor(size=336, max_patches=16)
    for height in SIDES:
        for width in SIDES:
            image = DecodedImage(b"", "", (width, height))
            if max(height, width) / min(height, width) <= 200:
                assert smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280) == (
                    _smart_resize_image(height, width, 28, 56 * 56, 28 * 28 * 1280))
            # The library's token grid, but one row (or column) where it gives none.
            expected = get_resize_output_image_size((height, width), 1024, 28)
            assert mistral._grid(image) == (max(1, expected[0] // 28),
                                            max(1, expected[1] // 28))
            assert lfm2._single(height, width)[::-1] == _smart_resize(
                height, width, 2, 64, 256, 16)
            assert lfm2._too_large(height, width) == _is_image_too_large(
                height, width, 256, 16, 2, 2.0)
            # LLaVA's shortest edge to 336 px (CLIP's processor, transformers' rule), but a
            # resize past 40 MP (a strip over about 1:350) refused.
            resized = get_output_size(np.broadcast_to(np.uint8(0), (height, width, 3)), 336,
                                      default_to_square=False,
                                      input_data_format="channels_last")
            # SmolVLM / Idefics3's longest edge to 2048 px (and 8192, past their 4096 bound).
            for longest in (2048, 8192):
                assert longest_edge_size(height, width, longest) == idefics3_size(
                    np.broadcast_to(np.uint8(0), (3, height, width)), longest)
            # Llama 4's grid of 336 px tiles (at most 16; its processor's grids hold 4).
            assert best_grid(width, height, 336, 16) == llama4._get_best_resolution(
                width, height)
            # Gemma 4's patch budget (its real 280 tokens of 16 px patches pooled 3x3).
            assert gemma4_size(height, width, 16, 280 * 9, 3) == (
                get_aspect_ratio_preserving_size(height, width, 16, 280 * 9, 3))
            if resized[0] * resized[1] <= 40_000_000:
                assert llava._resized_size(image) == resized
            else:
                with pytest.raises(InvalidRequestError, match="too long and thin"):
                    llava.read(image)
