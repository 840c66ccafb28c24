"""Image rows in the batch: the tower's cost, TTFT alone and beside decoding text rows, what
an image row's prefill costs the text rows, and a second turn over the same image (or, with
``--media audio``, the same for audio clips on a family that reads audio).

On a small random-weight Gemma 3 VLM built offline (``testkit.vision_model``: a SigLIP
tower at 224 px, 256 patches pooled to 64 image tokens, a 4-layer text model), so the
figures are the engine's and this machine's, not a real checkpoint's. Prints:

- the tower and projector per image (``stats().vision_seconds`` / images);
- an image row's time to first token alone, and beside ``--rows`` text rows decoding;
- the text rows' tokens/s while the image rows are in flight (from the first one's
  arrival to the last one's first token; each ends there), against the same text rows
  over the same seconds of a control run without images just after it (goal: >= 0.9;
  ``EngineConfig.vision_step_share``, 0.08, sets it: about 1/1.08 = 0.93 in theory), each
  run's ratio, and the longest gap with no text token while they were in flight;
- a conversation's second turn over the same image: TTFT with reuse (feature LRU and
  prefix cache) against an engine with both off (goal: >= 5x lower).

    python bench/vision.py [--rows 15] [--repeats 3] [--images 1] [--family gemma3]
                           [--media image|audio]

``--images 4 --rows 12``: 16 rows, a quarter carrying an image. ``--family qwen3_vl`` (any
served zoo family) runs on that family's tiny zoo checkpoint instead. ``--media audio``
sends each media row a synthesized clip instead of an image (``audio_message``: a 1.5 s
chirp, its own per row, as an OpenAI ``input_audio`` part) to a family that reads audio
(``--family gemma4``: its tiny zoo checkpoint has an audio tower); the table then counts
the tower per clip. A family without audio is refused by name.
"""

from __future__ import annotations

import argparse
import base64
import io
import math
import random
import statistics
import sys
import threading
import time
import wave
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import ChatRequest, Engine, EngineConfig, SamplingParams, blas_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for testkit.vision_model
from engine.requests.inbound.vision_families import Support, family_of
from testkit.vision_model import build_tiny_vlm, solid_image
from testkit.vision_zoo import ZOO

ZOO_FAMILIES = {e.model_type: e.build for e in ZOO
                if (f := family_of(e.model_type)) is not None and f.support is Support.IMAGES}
# Families whose zoo checkpoints read audio (``VisionFamily.audio``).
AUDIO_FAMILIES = sorted(name for name in ZOO_FAMILIES if (f := family_of(name)) and f.audio)
# A zoo checkpoint's directory version where its builder changed since a bench cached it
# (v2: Gemma 4's carries its audio tower).
ZOO_VERSIONS = {"gemma4": 2}

BENCH_SIZES = dict(hidden=256, layers=4, image_size=224, patch=14, tokens_per_image=64,
                   vision_hidden=192, vision_layers=4)


def bench_model() -> Path:
    root = Path.home() / ".cache" / "mlx-providers" / "bench" / "vlm-gemma3-bench-v1"
    if not (root / "config.json").exists():
        partial = root.with_name(root.name + ".tmp")
        build_tiny_vlm(partial, **BENCH_SIZES)
        partial.rename(root)
    return root


def zoo_model(family: str) -> Path:
    """A served family's tiny zoo checkpoint (``testkit.vision_zoo``), built once."""
    version = ZOO_VERSIONS.get(family, 1)
    root = Path.home() / ".cache" / "mlx-providers" / "bench" / f"zoo-{family}-v{version}"
    if not (root / "config.json").exists():
        partial = root.with_name(root.name + ".tmp")
        partial.mkdir(parents=True, exist_ok=True)
        ZOO_FAMILIES[family](partial)
        partial.rename(root)
    return root


def image_message(seed: int, text: str = "Describe the picture.") -> list[dict[str, Any]]:
    data = solid_image(((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256), 320,
                       noise=40, seed=seed)
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


CLIP_SECONDS = 1.5  # 38 audio tokens on Gemma 4 (one a 40 ms)
CLIP_RATE = 16_000


def chirp_wav(seed: int, seconds: float = CLIP_SECONDS, rate: int = CLIP_RATE) -> bytes:
    """A 16-bit mono PCM WAV (stdlib ``wave``): a linear chirp whose start and end pitch
    follow ``seed``, with a little seeded noise, so every seed's clip (and features) differ."""
    low = 150.0 + (seed * 37) % 500
    high = low + 400.0 + (seed * 61) % 900
    noise = random.Random(seed)
    count = int(seconds * rate)
    sweep = (high - low) / (2.0 * seconds)
    samples = array("h", (int(max(-1.0, min(1.0, 0.5 * math.sin(
        2.0 * math.pi * (low * t + sweep * t * t)) + noise.gauss(0.0, 0.05))) * 26_000)
        for t in (i / rate for i in range(count))))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def audio_message(seed: int, text: str = "Describe the sound.") -> list[dict[str, Any]]:
    """A user message with ``seed``'s clip as an OpenAI ``input_audio`` part."""
    data = base64.b64encode(chirp_wav(seed)).decode()
    return [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "text", "text": text}]}]


MediaMessage = Callable[..., list[dict[str, Any]]]
MEDIA: dict[str, MediaMessage] = {"image": image_message, "audio": audio_message}


class FirstToken:
    """Seconds from ``start`` to a row's first token (the callback runs on the engine thread);
    ``stop``: the row ends there."""

    def __init__(self, stop: bool = False) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.done = threading.Event()
        self._stop = stop

    def __call__(self, token: int, text: str) -> bool:
        if self.first is None:
            self.first = time.perf_counter() - self.start
            self.done.set()
        return not self._stop


def ttft(eng: Engine, messages: list[dict[str, Any]], tokens: int = 8) -> float:
    timer = FirstToken()
    eng.submit(ChatRequest.from_openai(messages, greedy(tokens)),
               on_token=timer).result(timeout=600)
    assert timer.first is not None
    return timer.first


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


class TokenClock:
    """Timestamps of every text row's tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, token: int, text: str) -> bool:
        self.times.append(time.perf_counter())
        return True

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / max(end - start, 1e-9)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time in [start, end) with no text token (stalls show here)."""
        inside = [start, *(t for t in self.times if start <= t < end), end]
        return max(b - a for a, b in pairwise(inside))


@dataclass(frozen=True)
class Beside:
    """One run of image rows arriving together beside decoding text rows, and its control.

    ``during``: the text rows' tok/s from the first image row's arrival to the last one's
    first token (each image row ends there). ``alone``: the same text rows' tok/s over the
    same seconds since they started, in a control run just after it in which no image
    comes. Their tokens are greedy, so the control's rows hold the same contexts at the
    same step: a text row's step grows with its context (on the tiny checkpoints its time
    doubles within the run), and only a run of the same rows matches that drift.
    ``before``/``after``: the image run's own tok/s in a window before the first image
    arrives and one after the last has left the batch (the drift, for the record).
    """

    ttft: float  # the last image row's first token, from the first arrival
    before: float  # text tok/s
    during: float
    after: float
    alone: float  # text tok/s over the same seconds of the control run
    stall: float  # the longest gap with no text token while the images were in flight

    @property
    def ratio(self) -> float:
        return self.during / self.alone


TEXT_TOKENS = 3000  # a text row outlives the run (its end would change the batch's width)
WINDOW = 0.6  # seconds of each bracketing window


@dataclass(frozen=True)
class TextRun:
    """Text rows' token times in one run, from when every row decodes (``steady``)."""

    clock: TokenClock
    steady: float
    arrived: float = 0.0  # the image rows' first arrival, their last first token, their end
    first: float = 0.0
    ended: float = 0.0


def text_rows(eng: Engine, rows: int, seed: int, images: int, length: float = 0.0,
              message: MediaMessage = image_message) -> TextRun:
    """``rows`` text rows decoding; ``images`` media rows (``message``'s: an image or a
    clip each) arrive ``WINDOW`` seconds after every row decodes, and the run goes on
    ``WINDOW`` seconds after they leave. Without images (a control), the run lasts
    ``length`` seconds from then."""
    clock = TokenClock()
    texts = [eng.submit(ChatRequest.from_openai(
        [{"role": "user", "content": f"Tell a long story about item {i}."}],
        greedy(TEXT_TOKENS)), on_token=clock) for i in range(rows)]
    while len(clock.times) < rows * 4:  # every row decoding
        time.sleep(0.01)
    steady = time.perf_counter()
    time.sleep(WINDOW)  # the text rows' own pace, measured before the images arrive
    run = TextRun(clock, steady)
    if images:
        # Encoded before they arrive: a client's work (the engine's caller decodes them,
        # inside the window, as an in-process caller would).
        messages = [message(seed * 10 + i) for i in range(images)]
        timers: list[FirstToken] = []
        handles = []
        for one in messages:
            timers.append(timer := FirstToken(stop=True))
            handles.append(eng.submit(ChatRequest.from_openai(one, greedy(4)),
                                      on_token=timer))
        for handle in handles:
            handle.result(timeout=600)
        ended = time.perf_counter()  # every image row is out of the batch
        assert all(timer.first is not None for timer in timers)
        run = TextRun(clock, steady, arrived=min(t.start for t in timers),
                      first=max(t.start + (t.first or 0.0) for t in timers), ended=ended)
        time.sleep(0.05 + WINDOW)  # and the text rows alone again
    else:
        time.sleep(length)
    if any(text.done for text in texts):
        raise RuntimeError("a text row ended inside the run: raise TEXT_TOKENS")
    for text in texts:
        text.cancel()
    for text in texts:
        text.result(timeout=600)
    return run


def beside_text_rows(eng: Engine, rows: int, seed: int, images: int = 1,
                     message: MediaMessage = image_message) -> Beside:
    """Image (or ``message``'s media) rows arriving together beside ``rows`` decoding text
    rows, then the same text rows alone (``Beside``)."""
    run = text_rows(eng, rows, seed, images, message=message)
    clock, arrived, first = run.clock, run.arrived, run.first
    control = text_rows(eng, rows, seed, 0, length=run.ended + 0.05 + WINDOW - arrived)
    since = control.steady - run.steady  # the same seconds since the rows decoded
    after = run.ended + 0.05
    return Beside(ttft=first - arrived, before=clock.rate(run.steady, arrived),
                  during=clock.rate(arrived, first), after=clock.rate(after, after + WINDOW),
                  alone=control.clock.rate(arrived + since, first + since),
                  stall=clock.longest_gap(arrived, first))


def second_turn(eng: Engine, seed: int, message: MediaMessage = image_message) -> float:
    """A second turn's TTFT over the first turn's image (or ``message``'s media)."""
    first = message(seed, "What is in it?")
    answer = eng.submit(ChatRequest.from_openai(first, greedy(12))).result(timeout=600)
    follow = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": "Say more about it."}]
    return ttft(eng, follow)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=1,
                        help="image (or audio) rows arriving together beside the text rows")
    parser.add_argument("--family", default="gemma3",
                        help="gemma3 (the bench-size model) or a served zoo family's tiny "
                             "checkpoint: " + ", ".join(sorted(ZOO_FAMILIES)))
    parser.add_argument("--media", choices=sorted(MEDIA), default="image",
                        help="what each media row carries: an image, or a synthesized "
                             "clip (a family that reads audio: "
                             + ", ".join(AUDIO_FAMILIES) + ")")
    args = parser.parse_args()
    if args.media == "audio" and args.family not in AUDIO_FAMILIES:
        family = family_of(args.family)
        parser.error(f"--media audio: {family.name if family else args.family} "
                     f"({args.family}) reads no audio; families that do: "
                     + ", ".join(AUDIO_FAMILIES))
    message = MEDIA[args.media]
    unit, rows_of = ("image", "image") if args.media == "image" else ("clip", "audio")
    model = bench_model() if args.family == "gemma3" else zoo_model(args.family)
    print(f"model: {model.name} "
          f"{BENCH_SIZES if args.family == 'gemma3' else 'tiny zoo checkpoint'}; "
          f"{blas_info()}")
    # Speculation off: drafted tokens would make the text rows' pace a measure of their drafts.
    eng = Engine(model, EngineConfig(max_batch=args.rows + 1, speculation=0)).start()
    cold = Engine(model, EngineConfig(max_batch=args.rows + 1, speculation=0, prefix_cache_bytes=0,
                                      vision_cache_bytes=0)).start()
    try:
        ttft(eng, message(10_000))  # warm-up: first shapes, first graphs
        ttft(cold, message(10_001))
        before = eng.stats()
        alone = [ttft(eng, message(seed)) for seed in range(args.repeats)]
        after = eng.stats()
        per_image = ((after.vision_seconds - before.vision_seconds)
                     / max(after.vision_images - before.vision_images, 1))
        beside = [beside_text_rows(eng, args.rows, 100 + seed, args.images, message)
                  for seed in range(args.repeats)]
        reused = [second_turn(eng, 200 + seed, message) for seed in range(args.repeats)]
        fresh = [second_turn(cold, 300 + seed, message) for seed in range(args.repeats)]
    finally:
        eng.close()
        cold.close()
    ratio = statistics.median(b.ratio for b in beside)
    print()
    print("| measure | value |")
    print("|---|---:|")
    print(f"| tower + projector per {unit} | {per_image * 1e3:.1f} ms |")
    print(f"| {rows_of} row TTFT alone | {statistics.median(alone) * 1e3:.1f} ms |")
    print(f"| last of {args.images} {rows_of} rows' TTFT beside {args.rows} decoding text "
          f"rows | {statistics.median(b.ttft for b in beside) * 1e3:.1f} ms |")
    print(f"| text rows' tok/s before the {unit}s / after them | "
          f"{statistics.median(b.before for b in beside):.0f} / "
          f"{statistics.median(b.after for b in beside):.0f} |")
    print(f"| text rows' tok/s alone over the same seconds (a control run) | "
          f"{statistics.median(b.alone for b in beside):.0f} |")
    print(f"| text rows' tok/s while they are in flight | "
          f"{statistics.median(b.during for b in beside):.0f} |")
    print(f"| longest text-token gap while they are in flight | "
          f"{statistics.median(b.stall for b in beside) * 1e3:.1f} ms |")
    runs = " ".join(f"{b.ratio:.2f}" for b in beside)
    print(f"| ratio (goal >= 0.9; each run: {runs}) | {ratio:.2f} |")
    print(f"| second turn TTFT, reuse off | {statistics.median(fresh) * 1e3:.1f} ms |")
    print(f"| second turn TTFT, reuse on | {statistics.median(reused) * 1e3:.1f} ms |")
    print(f"| second turn speed-up (goal >= 5x) | "
          f"{statistics.median(fresh) / statistics.median(reused):.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
