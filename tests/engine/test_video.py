"""Video rows in the one batch, on tiny Qwen-VL models of each generation (Qwen2-VL and
Qwen2.5-VL: one block, its temporal groups on the grid's time axis; Qwen3-VL and Qwen3.5: a
block per group after its ``<t seconds>``).

A video row equals itself alone and mlx-vlm's own greedy generation from the same frames,
with text and image rows beside it unchanged; the video decides the tokens; a second turn
over the same video skips tower and prefill; what cannot be read is refused by part.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import ChatRequest, Engine, InvalidRequestError, UnsupportedMediaError
from engine.requests.inbound import videos
from testkit.vision_model import vision_library_tokens
from tests.conftest import greedy, prompts_of_lengths, request_for
from tests.engine.test_vision import (
    RED,
    asking,
    image_part,
    tokens,
    vlm_engine,
    with_texts_batched,
)

pytestmark = pytest.mark.timeout(600)

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


def video_bytes(seed: int = 0, frames: int = 12, fps: float = 4.0,
                size: tuple[int, int] = (64, 48)) -> bytes:
    """An MP4 (mp4v) whose frames change colour over time, written by OpenCV."""
    import os
    import tempfile

    import cv2

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, 3)
    handle, path = tempfile.mkstemp(suffix=".mp4")
    os.close(handle)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
        for i in range(frames):
            frame = np.empty((size[1], size[0], 3), np.uint8)
            frame[:] = (base + i * np.array([23, 41, 67])) % 256
            frame[: size[1] // 2, : size[0] // 2] = 255 - frame[0, 0]  # a moving-ish patch
            writer.write(frame)
        writer.release()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def video_part(data: bytes) -> dict[str, Any]:
    url = f"data:video/mp4;base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.fixture(params=QWEN_FAMILIES)
def qwen_dir(request: pytest.FixtureRequest, family_dirs: Callable[[str], Path]) -> Path:
    return family_dirs(request.param)


def test_video_rows_batched_equal_alone_and_the_vision_library(
        make_engine: Callable[..., Engine], qwen_dir: Path) -> None:
    eng = vlm_engine(make_engine, qwen_dir, prefill_chunk=8)
    params = greedy(12)
    clips = [asking(video_part(video_bytes(0)), text="What happens?"),
             asking(video_part(video_bytes(1, frames=20, fps=5.0, size=(80, 64))),
                    text="And here?")]
    beside = [asking(image_part(RED), text="And this picture?")]
    texts = prompts_of_lengths(eng, [30, 12], seed=5)
    alone_clips = [tokens(eng, m, params) for m in clips]
    alone_beside = [tokens(eng, m, params) for m in beside]
    alone_texts, results = with_texts_batched(eng, texts, clips + beside, params)
    assert results[:2] == alone_texts
    assert results[2:4] == alone_clips
    assert results[4:] == alone_beside
    preparer = eng._runtime.preparer()
    for messages, ours in zip(clips, alone_clips):
        prepared = preparer.prepare(ChatRequest.from_openai(messages, params))
        assert prepared.images and all(i.video for i in prepared.images)
        reference = vision_library_tokens(qwen_dir, prepared.prompt_ids,
                                          [i.read_pixels() for i in prepared.images], 12,
                                          [dict(i.extra) for i in prepared.images])
        assert list(ours) == reference


def test_the_video_decides_the_tokens_and_a_second_turn_reuses_it(
        make_engine: Callable[..., Engine], qwen_dir: Path) -> None:
    eng = vlm_engine(make_engine, qwen_dir)
    params = greedy(10)
    first = asking(video_part(video_bytes(2)), text="What is it?")
    other = tokens(eng, asking(video_part(video_bytes(3)), text="What is it?"), params)
    answer = eng.submit(ChatRequest.from_openai(first, params)).result(timeout=120)
    assert answer.token_ids != other
    second = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": "Say more."}]
    before = eng.stats()
    again = eng.submit(ChatRequest.from_openai(second, params)).result(timeout=120)
    after = eng.stats()
    assert after.vision_images == before.vision_images  # no tower forward
    prompt = eng._runtime.preparer().prepare(ChatRequest.from_openai(first, params))
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= len(prompt.prompt_ids)
    fresh = vlm_engine(make_engine, qwen_dir, prefix_cache_bytes=0, vision_cache_bytes=0)
    assert again.token_ids == tokens(fresh, second, params)
    # The same clip after other text (no prefix to resume): its features come from the
    # feature cache, block by block.
    before = eng.stats()
    tokens(eng, [{"role": "system", "content": "Be brief."},
                 *asking(video_part(video_bytes(2)), text="Once more?")], params)
    assert eng.stats().vision_images == before.vision_images
    assert eng.stats().vision_feature_hits > before.vision_feature_hits


def test_langchain_style_video_blocks_are_read(make_engine: Callable[..., Engine],
                                               family_dirs: Callable[[str], Path]) -> None:
    model = family_dirs("qwen3_vl")
    eng = vlm_engine(make_engine, model)
    data = video_bytes(4)
    params = greedy(8)
    block = {"type": "video", "base64": base64.b64encode(data).decode(),
             "mime_type": "video/mp4"}
    assert tokens(eng, asking(block), params) == tokens(eng, asking(video_part(data)), params)


@pytest.mark.parametrize(("part", "refusal"), [
    ({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
     "remote video URLs are not fetched"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"
                                                + base64.b64encode(b"not a video").decode()}},
     "not a readable video"),
    ({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}},
     "local paths are not read"),
    ({"type": "video"}, "needs 'base64'"),
])
def test_unreadable_videos_are_refused_by_part(part: dict[str, Any], refusal: str) -> None:
    with pytest.raises(InvalidRequestError, match=refusal) as raised:
        ChatRequest.from_openai(asking(part), greedy(4))
    assert raised.value.field.startswith("messages[0].content[0]")


def test_a_video_over_the_length_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(videos, "MAX_SECONDS", 2.0)
    with pytest.raises(InvalidRequestError, match=r"lasts 3 s, over the limit of 2 s"):
        ChatRequest.from_openai(asking(video_part(video_bytes(5))), greedy(4))


def test_a_family_without_video_refuses_it_by_name(make_engine: Callable[..., Engine],
                                                   family_dirs: Callable[[str], Path]) -> None:
    eng = vlm_engine(make_engine, family_dirs("gemma3"))
    text = prompts_of_lengths(eng, [20], seed=1)[0]
    beside = eng.submit(request_for(text, greedy(6)))
    with pytest.raises(UnsupportedMediaError, match="reads images, not videos") as raised:
        eng.submit(ChatRequest.from_openai(asking(video_part(video_bytes(6))),
                                           greedy(4))).result(timeout=60)
    assert raised.value.family == "gemma3"
    assert beside.result(timeout=60).token_ids


def test_frames_are_sampled_at_the_familys_rate() -> None:
    # 12 frames at 4 fps (3 s), 2 a second: 6 frames, first to last, evenly spaced.
    assert videos.sample_indices(12, 4.0, rate=2.0, factor=2, min_frames=4,
                                 max_frames=768) == [0, 2, 4, 7, 9, 11]
    # A short clip still gets the least (4); a long one at most max_frames.
    assert len(videos.sample_indices(5, 10.0, rate=2.0, factor=2, min_frames=4,
                                     max_frames=768)) == 4
    assert len(videos.sample_indices(3000, 30.0, rate=2.0, factor=2, min_frames=4,
                                     max_frames=16)) == 16
