"""Image rows in the one batch, on tiny random-weight VLMs of each family (testkit.vision_model):
Gemma 3 (a fixed block), Mistral 3 (rows of the image's own aspect ratio), Qwen2-VL
(image tokens on a grid of positions, M-RoPE) and LFM2-VL (tiles and a thumbnail for a
large image, beside a hybrid conv and attention text model).

The heart of it: an image row's tokens equal the same request alone and mlx-vlm's own
single-request greedy generation; text rows beside it keep exactly their tokens; prefix
reuse never crosses images and skips the tower on a later turn over the same image;
cancelling image rows at any stage leaves nothing behind.
"""

from __future__ import annotations

import base64
import io
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, FinishReason, InvalidRequestError, SamplingParams
from engine.device.vision.tower import VisionTower
from testkit.vision_model import solid_image, vision_library_tokens
from tests.conftest import Turns, greedy, prompts_of_lengths, request_for, wait_until

pytestmark = pytest.mark.timeout(600)


def image_part(rgb: tuple[int, int, int], *, noise: int = 20, seed: int = 0,
               fmt: str = "PNG", size: tuple[int, int] = (40, 40)) -> dict[str, Any]:
    data = solid_image(rgb, size[0], noise=noise, seed=seed)
    if size[1] != size[0]:
        from PIL import Image

        buffer = io.BytesIO()
        Image.open(io.BytesIO(data)).resize(size).save(buffer, format="PNG")
        data = buffer.getvalue()
    if fmt != "PNG":
        from PIL import Image

        buffer = io.BytesIO()
        Image.open(io.BytesIO(data)).save(buffer, format=fmt)
        data = buffer.getvalue()
    mime = f"image/{fmt.lower()}"
    return {"type": "image_url",
            "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def asking(*parts: Any, text: str = "Describe it.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


RED, BLUE, GREEN = (220, 30, 30), (30, 40, 220), (30, 200, 40)


def vlm_engine(make_engine: Callable[..., Engine], model: Path, **config: Any) -> Engine:
    return make_engine(model, **{"max_batch": 16, **config})


def reuses_prefixes(eng: Engine) -> bool:
    """Whether the engine resumes prefixes on this model's caches (Llama 4's chunked
    attention caches run alone in the serial lane, which resumes none)."""
    return next(s for s in eng.stats().speedups if s.name == "prefix_reuse").on


def tokens(eng: Engine, messages: list[dict[str, Any]], params: SamplingParams,
           ) -> tuple[int, ...]:
    return eng.submit(ChatRequest.from_openai(messages, params)).result(timeout=120).token_ids


def with_texts_batched(eng: Engine, texts: list[list[int]], messages: list[Any],
                       params: SamplingParams, alone_timeout: float = 60,
                       ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The ``texts`` (prompt ids) each alone, then submitted at once with the chat rows
    ``messages``: (the texts' tokens alone, every row's tokens batched, texts first)."""
    alone = [eng.submit(request_for(p, params)).result(timeout=alone_timeout).token_ids
             for p in texts]
    handles = [eng.submit(request_for(p, params)) for p in texts]
    handles += [eng.submit(ChatRequest.from_openai(m, params)) for m in messages]
    return alone, [h.result(timeout=120).token_ids for h in handles]


def test_image_rows_batched_equal_alone_and_the_vision_library(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    tiny_vlm_dir = family_vlm_dir
    # A small chunk: the image rows' own prefill runs in several steps.
    eng = vlm_engine(make_engine, tiny_vlm_dir, prefill_chunk=8)
    params = greedy(16)
    images = [asking(image_part(RED)), asking(image_part(BLUE, seed=1, size=(100, 30)),
                                              text="And this?"),
              asking(image_part(GREEN, size=(20, 70)), image_part(RED, seed=2),
                     text="Compare them."),
              asking(image_part(BLUE, seed=4, size=(300, 200)), text="A large one."),
              [{"role": "user", "content": "Look:"}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": [image_part(BLUE, seed=3)]}]]
    texts = prompts_of_lengths(eng, [30, 70, 12], seed=3)
    alone_images = [tokens(eng, m, params) for m in images]
    alone_texts, results = with_texts_batched(eng, texts, images, params)
    assert results[:3] == alone_texts
    assert results[3:] == alone_images
    preparer = eng._runtime.preparer()
    for messages, ours in zip(images, alone_images):
        prepared = preparer.prepare(ChatRequest.from_openai(messages, params))
        assert len(prepared.images) == sum(
            isinstance(p, dict) and p.get("type") == "image_url"
            for m in messages for p in (m["content"] if isinstance(m["content"], list) else ()))
        reference = vision_library_tokens(tiny_vlm_dir, prepared.prompt_ids,
                                          [i.read_pixels() for i in prepared.images], 16,
                                          [dict(i.extra) for i in prepared.images])
        # The library's loop runs on past the end token, where the engine's row ends.
        assert list(ours) == reference[:len(ours)]
        assert len(ours) == 16 or reference[len(ours)] in eng.tokenizer.eos_token_ids
    assert eng.stats().vision_images >= 5


def test_the_image_decides_the_tokens(make_engine: Callable[..., Engine],
                                      family_vlm_dir: Path) -> None:
    tiny_vlm_dir = family_vlm_dir
    eng = vlm_engine(make_engine, tiny_vlm_dir, prefix_cache_bytes=0)
    params = greedy(12)
    red = tokens(eng, asking(image_part(RED)), params)
    blue = tokens(eng, asking(image_part(BLUE)), params)
    assert red != blue
    # The same pixels in another encoding are the same image: one tower forward, same tokens.
    before = eng.stats()
    assert tokens(eng, asking(image_part(RED, fmt="BMP")), params) == red
    after = eng.stats()
    assert after.vision_images == before.vision_images
    assert after.vision_feature_hits == before.vision_feature_hits + 1


def test_prefix_reuse_never_serves_another_image(make_engine: Callable[..., Engine],
                                                 family_vlm_dir: Path) -> None:
    tiny_vlm_dir = family_vlm_dir
    params = greedy(12)
    fresh = vlm_engine(make_engine, tiny_vlm_dir, prefix_cache_bytes=0, vision_cache_bytes=0)
    expected = {rgb: tokens(fresh, asking(image_part(rgb)), params) for rgb in (RED, BLUE)}
    eng = vlm_engine(make_engine, tiny_vlm_dir)
    for rgb in (RED, BLUE, RED, BLUE):
        assert tokens(eng, asking(image_part(rgb)), params) == expected[rgb]
    # Both images' prompts were stored; the text before the image was shared (a model with
    # recurrent layers resumes only whole stored prompts, so its repeats are not hits).
    stats = eng.stats()
    assert (stats.prefix_hits >= 3 or "ArraysCache" in stats.cache_kinds
            or not reuses_prefixes(eng))


def test_a_second_turn_over_the_same_image_skips_tower_and_prefill(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    tiny_vlm_dir = family_vlm_dir
    params = greedy(10)
    first = asking(image_part(GREEN), text="What is it?")
    eng = vlm_engine(make_engine, tiny_vlm_dir)
    answer = eng.submit(ChatRequest.from_openai(first, params)).result(timeout=120)
    second = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": "Say more."}]
    before = eng.stats()
    again = eng.submit(ChatRequest.from_openai(second, params)).result(timeout=120)
    after = eng.stats()
    assert after.vision_images == before.vision_images  # no tower forward
    if reuses_prefixes(eng):
        assert after.vision_feature_hits == before.vision_feature_hits  # not even a lookup
        reused = after.prefix_hit_tokens - before.prefix_hit_tokens
        prompt = eng._runtime.preparer().prepare(ChatRequest.from_openai(first, params))
        assert reused >= len(prompt.prompt_ids)  # the whole first prompt, image included
    else:  # no prefix resumed: the image's features from the LRU, the prompt prefilled
        assert after.vision_feature_hits == before.vision_feature_hits + 1
    fresh = vlm_engine(make_engine, tiny_vlm_dir, prefix_cache_bytes=0, vision_cache_bytes=0)
    assert again.token_ids == tokens(fresh, second, params)


def test_a_multi_image_conversation_resumes_and_reads_only_its_new_image(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    params = greedy(8)
    first = asking(image_part(RED, seed=7), image_part(BLUE, seed=8), text="Compare them.")
    eng = vlm_engine(make_engine, family_vlm_dir)
    answer = eng.submit(ChatRequest.from_openai(first, params)).result(timeout=120)
    second = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": [image_part(GREEN, seed=9),
                                           {"type": "text", "text": "And this one?"}]}]
    before = eng.stats()
    again = eng.submit(ChatRequest.from_openai(second, params)).result(timeout=120)
    after = eng.stats()
    assert after.vision_images == before.vision_images + 1  # only the new image's tower
    prompt = eng._runtime.preparer().prepare(ChatRequest.from_openai(first, params))
    assert (after.prefix_hit_tokens - before.prefix_hit_tokens >= len(prompt.prompt_ids)
            or not reuses_prefixes(eng))
    fresh = vlm_engine(make_engine, family_vlm_dir, prefix_cache_bytes=0, vision_cache_bytes=0)
    assert again.token_ids == tokens(fresh, second, params)


def test_cancel_storm_with_image_rows_leaves_nothing(make_engine: Callable[..., Engine],
                                                     tiny_vlm_dir: Path) -> None:
    turns = Turns()
    eng = vlm_engine(make_engine, tiny_vlm_dir, max_batch=6, prefill_chunk=8,
                     prefix_cache_bytes=0, vision_cache_bytes=0, probe=turns.probe)
    params = greedy(20)
    rng = random.Random(7)
    texts = prompts_of_lengths(eng, [rng.randrange(4, 80) for _ in range(8)], seed=4)
    images = [asking(image_part((rng.randrange(256), rng.randrange(256), rng.randrange(256)),
                                seed=k)) for k in range(16)]
    reference = [eng.submit(request_for(p, params)).result(timeout=60).token_ids
                 for p in texts]
    kept_image = tokens(eng, images[0], params)

    def storm() -> None:
        handles = [eng.submit(request_for(p, params)) for p in texts]
        image_handles = [eng.submit(ChatRequest.from_openai(m, params)) for m in images]
        for handle in image_handles[1:]:  # before the tower, in the image prefill, decoding
            time.sleep(rng.random() * 0.02)
            handle.cancel()
        assert [h.result(timeout=120).token_ids for h in handles] == reference
        assert image_handles[0].result(timeout=120).token_ids == kept_image
        finished = [h.result(timeout=120) for h in image_handles[1:]]
        assert any(r.finish_reason is FinishReason.CANCELLED for r in finished)
        settled = turns.settled()
        assert settled.lane_rows == {"batch": 0, "serial": 0} and settled.batch_kv_bytes == 0

    storm()  # the first also allocates what every later batch reuses
    after_first = settled_memory(eng)
    storm()
    composition = eng._runtime.composition
    assert composition is not None
    lanes = composition.built.lanes
    assert lanes.batch.vision is not None and len(lanes.batch.vision) == 0
    stats = eng.stats()
    assert stats.vision_feature_bytes == 0  # vision_cache_bytes=0 keeps none
    # A second storm leaves nothing more behind: not a row's cache nor an image's features
    # (kilobytes each here); MLX may keep a scalar or two of its own.
    assert settled_memory(eng) <= after_first + 256


def settled_memory(eng: Engine) -> int:
    """MLX's active bytes once the idle engine's figure stops moving (the last turn's
    arrays are let go after it publishes)."""
    readings = [eng.stats().mlx_active_bytes]
    while len(readings) < 4 or len(set(readings[-3:])) > 1:
        time.sleep(0.1)
        readings.append(eng.stats().mlx_active_bytes)
        assert len(readings) < 100, readings
    return readings[-1]


def test_a_failing_image_fails_alone(make_engine: Callable[..., Engine], tiny_vlm_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    eng = vlm_engine(make_engine, tiny_vlm_dir)
    params = greedy(12)
    text = prompts_of_lengths(eng, [20], seed=9)[0]
    good = asking(image_part(RED))
    expected_text = eng.submit(request_for(text, params)).result(timeout=60).token_ids
    expected_image = tokens(eng, good, params)
    real = VisionTower.start
    bad_key: list[str] = []

    def failing(self: VisionTower, image: Any) -> Any:
        if image.key in bad_key:
            raise RuntimeError("the tower failed on this image")
        return real(self, image)

    monkeypatch.setattr(VisionTower, "start", failing)
    bad = asking(image_part(BLUE, seed=5))
    bad_key.append(eng._runtime.preparer().prepare(
        ChatRequest.from_openai(bad, params)).images[0].key)
    handles = [eng.submit(request_for(text, params)),
               eng.submit(ChatRequest.from_openai(bad, params)),
               eng.submit(ChatRequest.from_openai(good, params))]
    with pytest.raises(RuntimeError, match="the tower failed"):
        handles[1].result(timeout=60)
    assert handles[0].result(timeout=60).token_ids == expected_text
    assert handles[2].result(timeout=60).token_ids == expected_image


def test_a_text_model_refuses_images_by_part(make_engine: Callable[..., Engine]) -> None:
    eng = make_engine()
    handle = eng.submit(ChatRequest.from_openai(asking(image_part(RED)), greedy(4)))
    with pytest.raises(InvalidRequestError, match=r"content\[0\].*takes no images"):
        handle.result(timeout=60)


def test_seeded_image_rows_run_alone_and_read_their_image(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    """A seeded row runs on the serial lane, image and all: at a temperature so low that
    sampling is the argmax it gives the greedy batch row's tokens (which equal the vision
    library's), and its seed reproduces it beside other rows."""
    eng = vlm_engine(make_engine, family_vlm_dir)
    greedy_row = tokens(eng, asking(image_part(RED)), greedy(10))
    cold = SamplingParams(max_tokens=10, temperature=1e-4, seed=3)
    assert tokens(eng, asking(image_part(RED)), cold) == greedy_row
    warm = SamplingParams(max_tokens=10, temperature=0.9, seed=5)
    alone = tokens(eng, asking(image_part(BLUE)), warm)
    beside = [eng.submit(ChatRequest.from_openai(asking(image_part(GREEN)), greedy(10))),
              eng.submit(ChatRequest.from_openai(asking(image_part(BLUE)), warm))]
    assert beside[1].result(timeout=120).token_ids == alone
    wait_until(lambda: eng.stats().running == 0 and eng.stats().vision_jobs == 0)


def test_a_text_row_sharing_the_head_gets_its_own_tokens(
        make_engine: Callable[..., Engine], family_vlm_dir: Path) -> None:
    # The text before an image is shared with a text-only row, except where the image row's
    # cache is kept shifted to its grid positions (M-RoPE): then nothing is shared.
    params = greedy(12)
    system = {"role": "system", "content": "You look at pictures and describe them well."}
    image_chat = [system, *asking(image_part(RED), text="What is it?")]
    text_chat = [system, {"role": "user", "content": "What is it?"}]
    fresh = vlm_engine(make_engine, family_vlm_dir, prefix_cache_bytes=0)
    expected = tokens(fresh, text_chat, params)
    eng = vlm_engine(make_engine, family_vlm_dir)
    tokens(eng, image_chat, params)
    assert tokens(eng, text_chat, params) == expected
    assert tokens(eng, image_chat, params) == tokens(fresh, image_chat, params)


def test_a_text_model_imports_nothing_of_the_vision_stack(tiny_model_dir: Path) -> None:
    # A text-only user pays nothing: serving a text model through the engine, LangChain's
    # face and the server imports neither mlx-vlm nor what it pulls in. (Pillow may be
    # imported by transformers or LlamaIndex themselves where it is installed.)
    import json
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import engine\n"
        "from engine import ChatRequest, Engine, EngineConfig, SamplingParams\n"
        "import mlx_providers.langchain\n"
        "from mlx_providers.server import create_app\n"
        f"eng = Engine({str(tiny_model_dir)!r}, EngineConfig()).start()\n"
        "eng.submit(ChatRequest.from_openai([{'role': 'user', 'content': 'hi'}],\n"
        "           SamplingParams(max_tokens=3))).result(60)\n"
        "eng.close()\n"
        "import json\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "engine" in loaded and "mlx_lm" in loaded
    assert not loaded & {"mlx_vlm", "cv2", "datasets", "mlx_audio", "torch", "pyarrow"}


def test_the_tower_and_its_features_count_in_the_memory_bound(
        make_engine: Callable[..., Engine], tiny_vlm_dir: Path) -> None:
    small = vlm_engine(make_engine, tiny_vlm_dir, vision_cache_bytes=0, kv_budget_bytes=1 << 26)
    large = vlm_engine(make_engine, tiny_vlm_dir, vision_cache_bytes=64 << 20,
                       kv_budget_bytes=1 << 26)
    for eng in (small, large):
        tokens(eng, asking(image_part(RED)), greedy(2))
    grown = large.stats().resident_bound_bytes - small.stats().resident_bound_bytes
    # The LRU's cap, give or take the runtime each process measured at its load.
    assert abs(grown - (64 << 20)) < 16 << 20
