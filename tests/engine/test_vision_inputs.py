"""An image's way into the prompt, per family, against mlx-vlm's own processor: the prompt ids
the engine builds equal the processor's for the image before and after the text.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine
from tests.conftest import greedy
from tests.engine.test_vision import BLUE, RED, image_part, vlm_engine

pytestmark = pytest.mark.timeout(600)

# What each family's own chat template writes for an image part, which its processor
# expands into the image's block.
PLACEHOLDERS = {"gemma3": "<start_of_image>", "mistral3": "[IMG]",
                "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "lfm2-vl": "<image>"}


def processor_prompt_ids(model_dir: Path, messages: list[dict[str, Any]],
                         images: list[dict[str, Any]]) -> list[int]:
    """mlx-vlm's prompt ids: the chat template's text with the family's placeholder for
    each image, expanded and tokenized by the family's processor (``load_processor``)."""
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
    ids = processor(text=[text], images=pictures)["input_ids"]
    return [int(t) for t in ids.tolist()[0]]


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
    assert prepared.prompt_ids == processor_prompt_ids(family_vlm_dir, messages, images)
