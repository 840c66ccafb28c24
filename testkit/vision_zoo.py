"""The vision zoo: a tiny random checkpoint of every vision family users load, and what the
engine does with it, observed.

Each entry builds its family's checkpoint from the family's own config layout, offline
(``testkit.vision_model`` for the families whose images are served,
``testkit.vision_zoo_builders`` for the rest). ``observe`` loads it in the engine and
says what happened: images served (an image row batched beside text rows equals itself
alone and mlx-vlm's own greedy generation, token for token, and the text rows keep their
tokens), text served with images refused by name (``UnsupportedMediaError``), or the load
refused (``UnsupportedModelError``). ``tests/engine/test_vision_zoo.py`` holds every
observation to the declared table (``engine.requests.inbound.vision_families``).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import (
    ChatRequest,
    Engine,
    SamplingParams,
    TextRequest,
    UnsupportedMediaError,
    UnsupportedModelError,
)
from engine.errors import ModelLoadError
from engine.requests.inbound.vision_families import Support
from testkit import vision_model
from testkit.vision_model import solid_image, vision_library_tokens


@dataclass(frozen=True)
class ZooEntry:
    """One checkpoint of the zoo: its ``model_type``, a name for its variant, its builder;
    ``first``: the family's one checkpoint ``make test`` runs (the rest run fitted)."""

    model_type: str
    variant: str
    build: Callable[[Path], Path]
    first: bool = True
    # Whose greedy text the text side must equal: the vision library's, or mlx-lm's own
    # (Gemma 3n: mlx-vlm's generation differs from its own language model's forward on text,
    # through the per-layer inputs its get_input_embeddings returns; the forwards agree).
    text_reference: str = "vision library"


@dataclass(frozen=True)
class Observed:
    """What the engine did with a checkpoint (``reason``: its refusal's, if refused)."""

    support: Support
    reason: str | None = None


def _entries() -> list[ZooEntry]:
    from testkit import vision_zoo_builders as more

    served = [
        ZooEntry("qwen3_5", "dense", vision_model.build_tiny_qwen3_5),
        ZooEntry("qwen3_5_moe", "moe", vision_model.build_qwen3_5_moe, first=False),
        ZooEntry("qwen3_vl", "deepstack", vision_model.build_tiny_qwen3_vl),
        ZooEntry("qwen2_5_vl", "windowed tower", vision_model.build_tiny_qwen2_5_vl),
        ZooEntry("qwen2_vl", "", vision_model.build_tiny_qwen2_vl),
        ZooEntry("gemma3", "", vision_model.build_tiny_vlm),
        ZooEntry("mistral3", "", vision_model.build_tiny_mistral3),
        ZooEntry("lfm2_vl", "", vision_model.build_tiny_lfm2_vl),
    ]
    # Gemma 3n's tower is fixed at 294M parameters whatever its config says (a 591 MB
    # checkpoint, ~40 s a tower forward here): it runs with the fitted proofs only.
    variants = {"mistral3": "ministral3 text", "gemma3n": "full-size tower"}
    others = [ZooEntry(model_type, variants.get(model_type, ""), builder,
                       first=model_type not in ("gemma3n", "idefics3"),
                       text_reference="mlx-lm" if model_type == "gemma3n" else "vision library")
              for model_type, builder in more.ZOO_BUILDERS.items()]
    return served + others


ZOO: list[ZooEntry] = _entries()

RED, BLUE = (220, 30, 30), (30, 40, 220)
TEXT_IDS = (17, 230, 41, 512, 9, 77, 301, 5)  # a text prompt every zoo vocabulary holds


def image_message(rgb: tuple[int, int, int], size: int = 40, seed: int = 0,
                  text: str = "Describe it.") -> list[dict[str, Any]]:
    """A user message with one PNG image part and a question."""
    data = solid_image(rgb, size, noise=20, seed=seed)
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def mlx_lm_tokens(path: Path, prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx-lm's own single-request generation of the checkpoint's text."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))[:2]
    out: list[int] = []
    for token, _ in generate_step(mx.array(list(prompt_ids)), model, max_tokens=max_tokens):
        out.append(int(token))
    return out


def observe(start: Callable[[Path], Engine], path: Path, max_tokens: int = 10,
            text_reference: str = "vision library") -> Observed:
    """Load ``path`` with ``start`` and see what the engine does with an image: served
    exactly (asserted here), images refused by name, or the load refused."""
    try:
        eng = start(path)
    except (UnsupportedModelError, ModelLoadError) as exc:
        return Observed(Support.NONE, str(exc))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    text = TextRequest(list(TEXT_IDS), params)
    text_alone = eng.submit(text).result(timeout=120).token_ids
    # The text side is the vision library's language model: its greedy tokens, exactly.
    reference = (mlx_lm_tokens(path, TEXT_IDS, max_tokens) if text_reference == "mlx-lm"
                 else vision_library_tokens(path, TEXT_IDS, [], max_tokens))
    assert list(text_alone) == reference, f"the text side differs from the {text_reference}'s"
    support = eng.image_support
    images = [image_message(RED), image_message(BLUE, size=90, seed=1, text="And this?")]
    if not support.served:
        try:
            eng.submit(ChatRequest.from_openai(images[0], params)).result(timeout=120)
        except UnsupportedMediaError as exc:
            assert exc.family == support.family and exc.reason == support.reason
            assert exc.field == "messages[0].content[0]"
            return Observed(Support.TEXT, exc.reason)
        raise AssertionError(f"{path.name}: an image row was served though image_support "
                             f"says {support}")
    alone = [eng.submit(ChatRequest.from_openai(m, params)).result(timeout=120).token_ids
             for m in images]
    handles = [eng.submit(text)] + [eng.submit(ChatRequest.from_openai(m, params))
                                    for m in images]
    together = [h.result(timeout=120).token_ids for h in handles]
    assert together[0] == text_alone, "the text row beside image rows keeps its tokens"
    assert together[1:] == alone, "image rows batched equal each alone"
    preparer = eng._runtime.preparer()
    for messages, ours in zip(images, alone):
        prepared = preparer.prepare(ChatRequest.from_openai(messages, params))
        reference = vision_library_tokens(path, prepared.prompt_ids,
                                          [i.read_pixels() for i in prepared.images],
                                          max_tokens, [dict(i.extra) for i in prepared.images])
        assert list(ours) == reference, "an image row equals the vision library's own"
    return Observed(Support.IMAGES)

