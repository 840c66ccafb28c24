"""Audio parts: OpenAI's ``input_audio`` and LangChain v1 ``audio`` blocks decoded on the
caller's thread to mono 16 kHz, refused by part where they are not audio or too long, and
refused by name by a model whose family's audio is not read (only Gemma 4's is, where the
checkpoint has an audio tower: tests/engine/test_audio_gemma4.py) while text rows beside
them are untouched."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import ChatRequest, Engine, InvalidRequestError, UnsupportedMediaError
from engine.requests.inbound import audio
from tests.conftest import greedy, prompts_of_lengths, request_for
from tests.engine.test_vision import asking, vlm_engine

pytestmark = pytest.mark.timeout(300)


def wav_bytes(seconds: float = 0.5, rate: int = 44_100, channels: int = 2,
              tone: float = 440.0) -> bytes:
    """A 16-bit PCM WAV of a sine tone."""
    t = np.arange(int(seconds * rate)) / rate
    wave_data = (np.sin(2 * np.pi * tone * t) * 0.5 * 32767).astype(np.int16)
    frames = np.repeat(wave_data[:, None], channels, axis=1)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames.tobytes())
    return buffer.getvalue()


def input_audio(data: bytes, kind: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": kind}}


def test_a_clip_is_decoded_to_mono_16khz_and_hashed_by_its_samples() -> None:
    [message] = ChatRequest.from_openai(asking(input_audio(wav_bytes(0.5))),
                                        greedy(4)).messages
    (clip,) = message.images
    assert isinstance(clip, audio.DecodedAudio)
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert abs(len(clip.samples) - 8000) <= 2  # 0.5 s at 16 kHz
    assert 0.4 < float(np.abs(clip.samples).max()) <= 0.51  # the tone's amplitude, kept
    # The same bytes as a LangChain block are the same clip (keyed by its samples).
    block = {"type": "audio", "base64": base64.b64encode(wav_bytes(0.5)).decode(),
             "mime_type": "audio/wav"}
    [again] = ChatRequest.from_openai(asking(block), greedy(4)).messages
    assert again.images[0].digest == clip.digest


@pytest.mark.parametrize(("part", "refusal"), [
    (input_audio(b"definitely not audio"), "not readable audio"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}},
     "'ogg' audio is not read"),
    ({"type": "input_audio"}, "needs {'data'"),
    ({"type": "audio", "url": "https://example.com/a.wav"}, "remote audio URLs are not"),
])
def test_unreadable_audio_is_refused_by_part(part: dict[str, Any], refusal: str) -> None:
    with pytest.raises(InvalidRequestError, match=refusal) as raised:
        ChatRequest.from_openai(asking(part), greedy(4))
    assert raised.value.field.startswith("messages[0].content[0]")


def test_a_clip_over_the_length_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audio, "MAX_SECONDS", 1.0)
    with pytest.raises(InvalidRequestError, match=r"lasts 2 s, over the limit of 1 s"):
        ChatRequest.from_openai(asking(input_audio(wav_bytes(2.0))), greedy(4))


def test_models_refuse_audio_by_name_and_text_rows_are_untouched(
        make_engine: Callable[..., Engine], family_dirs: Callable[[str], Path]) -> None:
    for eng, family in ((make_engine(), None),
                        (vlm_engine(make_engine, family_dirs("qwen3_vl")), "qwen3_vl")):
        text = prompts_of_lengths(eng, [20], seed=2)[0]
        alone = eng.submit(request_for(text, greedy(6))).result(timeout=60).token_ids
        beside = eng.submit(request_for(text, greedy(6)))
        with pytest.raises(UnsupportedMediaError, match="audio") as raised:
            eng.submit(ChatRequest.from_openai(asking(input_audio(wav_bytes())),
                                               greedy(4))).result(timeout=60)
        assert raised.value.family == family
        assert raised.value.field == "messages[0].content[0]"
        assert beside.result(timeout=60).token_ids == alone
