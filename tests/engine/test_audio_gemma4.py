"""Gemma 4 reads audio (the small models' conformer tower), on the tiny zoo checkpoint with an
audio tower (``testkit.vision_zoo_builders.build_tiny_gemma4``).

The prompt ids equal mlx-vlm's ``Gemma4Processor``'s (``<|audio>``, one ``<|audio|>`` a
40 ms of the clip rounded up, ``<audio|>``); an audio row batched beside text rows equals
itself alone and mlx-vlm's own single-request greedy generation from its processor's ids and
features, token for token, with the row's prefill cut inside the clip or not; the text rows
keep their tokens. A second turn over the same clip reads its features from the cache. A
Gemma 4 checkpoint without an audio tower refuses audio by name, and a clip longer than the
feature extractor reads (30 s) is refused by part. Clips are synthesized (``wave``).
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import shutil
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import ChatRequest, Engine, InvalidRequestError, UnsupportedMediaError
from testkit.vision_model import vision_library_greedy
from tests.conftest import greedy, prompts_of_lengths, request_for
from tests.engine.test_vision import RED, image_part, with_texts_batched

pytestmark = pytest.mark.timeout(600)
QUESTION = {"type": "text", "text": "What is it?"}


def tone_wav(seconds: float, tone: float = 440.0, rate: int = 16_000,
             channels: int = 1) -> bytes:
    """A 16-bit PCM WAV of a sine tone with a little seeded noise."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(int(tone)).normal(0.0, 0.05, len(t))
    samples = ((np.sin(2 * np.pi * tone * t) * 0.5 + noise) * 32767 * 0.8).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(samples[:, None], channels, axis=1).tobytes())
    return buffer.getvalue()


def audio_part(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


@pytest.fixture
def gemma4(family_dirs: Callable[[str], Path]) -> Path:
    path = family_dirs("gemma4")
    assert json.loads((path / "config.json").read_text())["audio_config"] is not None
    return path


def library(path: Path, content: list[dict[str, Any]], max_tokens: int,
            ) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of mlx-vlm for a user message: the chat template's text
    with ``<|audio|>`` / ``<|image|>`` where the parts were, expanded by its
    ``Gemma4Processor`` (which also reads the clips, as the engine decoded them, and the
    images), then its own ``generate_step`` with the processor's features and token types."""
    import mlx.core as mx
    from PIL import Image

    importlib.import_module("mlx_vlm.models.gemma4")  # its processor
    from mlx_vlm.utils import load_model, load_processor

    processor = load_processor(path, add_detokenizer=False)
    marks = {"input_audio": "<|audio|>", "image_url": "<|image|>"}
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "".join(marks.get(p["type"], p.get("text", ""))
                                             for p in content)}],
        tokenize=False, add_generation_prompt=True)
    [message] = ChatRequest.from_openai([{"role": "user", "content": content}],
                                        greedy(1)).messages
    clips = [m.samples for m in message.images if hasattr(m, "samples")]
    pictures = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",")[1])))
                .convert("RGB") for p in content if p["type"] == "image_url"]
    out = processor(text=[text], audio=clips or None, images=pictures or None)
    ids = out["input_ids"]
    kwargs = {k: out[k] for k in ("input_features", "input_features_mask",
                                  "mm_token_type_ids") if k in out}
    pixels = out.get("pixel_values")
    if isinstance(pixels, list):
        pixels = mx.array(np.stack([np.array(p) for p in pixels]))
    tokens = vision_library_greedy(load_model(path), ids, pixels, max_tokens, **kwargs)
    return [int(t) for t in ids.tolist()[0]], tokens


def ours(eng: Engine, content: list[dict[str, Any]], max_tokens: int = 8) -> tuple[int, ...]:
    request = ChatRequest.from_openai([{"role": "user", "content": content}],
                                      greedy(max_tokens))
    return eng.submit(request).result(timeout=120).token_ids


def prompt_ids(eng: Engine, content: list[dict[str, Any]]) -> list[int]:
    request = ChatRequest.from_openai([{"role": "user", "content": content}], greedy(4))
    return list(eng._runtime.preparer().prepare(request).prompt_ids)


CONTENTS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "clip first": lambda: [audio_part(tone_wav(1.0)), QUESTION],
    "clip last, an odd length": lambda: [QUESTION, audio_part(tone_wav(0.731, 660.0))],
    "two clips": lambda: [audio_part(tone_wav(0.5, 330.0)), QUESTION,
                          audio_part(tone_wav(0.5, 880.0))],
    "an image and a clip": lambda: [image_part(RED), audio_part(tone_wav(0.6)), QUESTION],
    "44.1 kHz stereo": lambda: [audio_part(tone_wav(0.8, 520.0, 44_100, 2)), QUESTION],
}


@pytest.mark.parametrize("name", list(CONTENTS))
def test_prompt_ids_and_tokens_equal_the_vision_librarys(
        make_engine: Callable[..., Engine], gemma4: Path, name: str) -> None:
    eng = make_engine(gemma4, max_batch=8, prefill_chunk=16)  # chunks cut the clips
    content = CONTENTS[name]()
    ids, reference = library(gemma4, content, 8)
    assert prompt_ids(eng, content) == ids
    assert list(ours(eng, content)) == reference


def test_an_audio_row_batched_beside_text_rows_equals_itself_alone(
        make_engine: Callable[..., Engine], gemma4: Path) -> None:
    eng = make_engine(gemma4, max_batch=8, prefill_chunk=16)
    texts = prompts_of_lengths(eng, [12, 30], seed=3)
    contents = [CONTENTS["clip first"](), CONTENTS["two clips"]()]
    alone = [ours(eng, c) for c in contents]
    text_alone, together = with_texts_batched(
        eng, texts, [[{"role": "user", "content": c}] for c in contents], greedy(8),
        alone_timeout=120)
    assert together[:2] == text_alone, "text rows beside audio rows keep their tokens"
    assert together[2:] == alone, "audio rows batched equal each alone"
    assert alone[0] != alone[1]  # the clips are read: other clips, other tokens


def test_another_clip_changes_the_answer_and_a_repeat_reads_cached_features(
        make_engine: Callable[..., Engine], gemma4: Path) -> None:
    eng = make_engine(gemma4, max_batch=8)
    first = ours(eng, [audio_part(tone_wav(1.0, 440.0)), QUESTION])
    assert ours(eng, [audio_part(tone_wav(1.0, 1200.0)), QUESTION]) != first
    before = eng.stats()
    # The same samples in another encoding (stereo) are the same clip; after other text it
    # is another prompt (no cached prefix reaches the clip): its features come from the
    # cache, the tower does not run, and the answer is the vision library's.
    content = [{"type": "text", "text": "Listen."},
               audio_part(tone_wav(1.0, 440.0, channels=2)), QUESTION]
    again = ours(eng, content)
    after = eng.stats()
    assert after.vision_feature_hits == before.vision_feature_hits + 1
    assert after.vision_images == before.vision_images
    assert list(again) == library(gemma4, content, 8)[1]


def test_a_gemma4_without_an_audio_tower_refuses_audio_by_name(
        make_engine: Callable[..., Engine], gemma4: Path, tmp_path: Path) -> None:
    plain = tmp_path / "gemma4-no-audio"
    shutil.copytree(gemma4, plain)
    config = json.loads((plain / "config.json").read_text())
    config["audio_config"] = None
    (plain / "config.json").write_text(json.dumps(config))
    eng = make_engine(plain, max_batch=8)
    text = prompts_of_lengths(eng, [20], seed=2)[0]
    alone = eng.submit(request_for(text, greedy(6))).result(timeout=60).token_ids
    beside = eng.submit(request_for(text, greedy(6)))
    with pytest.raises(UnsupportedMediaError, match="reads no audio") as raised:
        ours(eng, [audio_part(tone_wav(0.5)), QUESTION])
    assert raised.value.family == "gemma4"
    assert raised.value.field == "messages[0].content[0]"
    assert beside.result(timeout=60).token_ids == alone
    assert ours(eng, [image_part(RED), QUESTION])  # its images are still read


def test_a_clip_longer_than_the_feature_extractor_reads_is_refused_by_part(
        make_engine: Callable[..., Engine], gemma4: Path) -> None:
    eng = make_engine(gemma4, max_batch=8)
    with pytest.raises(InvalidRequestError, match=r"lasts 30\.1 s; this model reads at most "
                                                  r"30 s a clip") as raised:
        ours(eng, [QUESTION, audio_part(tone_wav(30.1))])
    assert raised.value.field == "messages[0].content[1]"


def test_a_second_turn_over_the_same_clip_resumes_past_it(
        make_engine: Callable[..., Engine], gemma4: Path) -> None:
    first = [{"role": "user", "content": [audio_part(tone_wav(1.0)), QUESTION]}]
    eng = make_engine(gemma4, max_batch=8)
    answer = eng.submit(ChatRequest.from_openai(first, greedy(8))).result(timeout=120)
    second = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": "Say more."}]
    before = eng.stats()
    again = eng.submit(ChatRequest.from_openai(second, greedy(8))).result(timeout=120)
    after = eng.stats()
    # No tower forward, not even a feature lookup: the whole first prompt, clip included,
    # comes from the prefix store.
    assert after.vision_images == before.vision_images
    assert after.vision_feature_hits == before.vision_feature_hits
    prompt = eng._runtime.preparer().prepare(ChatRequest.from_openai(first, greedy(8)))
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= len(prompt.prompt_ids)
    fresh = make_engine(gemma4, max_batch=8, prefix_cache_bytes=0, vision_cache_bytes=0)
    assert again.token_ids == fresh.submit(
        ChatRequest.from_openai(second, greedy(8))).result(timeout=120).token_ids
