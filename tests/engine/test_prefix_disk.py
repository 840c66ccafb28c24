"""The prefix store's disk tier: a restarted engine reads its prefixes back, and only its own.

Each test runs two engines one after the other on the same ``prefix_cache_dir`` (the
second is the "restart"), and compares tokens with an engine that reuses nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import engine.device.prefix.prefix_disk as prefix_disk
from engine import Engine, EngineConfig
from tests.conftest import greedy, request_for

SYSTEM = "You are an agent with tools. " + " ".join(f"tool{i}: does thing {i}." for i in range(60))


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def answer(model: Path, question: str, **config: Any) -> tuple[Any, Any]:
    """One request on a fresh engine: its result and the engine's stats after it."""
    with Engine(model, EngineConfig(**config)) as eng:
        result = eng.submit(request_for(conversation(question), greedy(16))).result(timeout=120)
        return result, eng.stats()


def files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.prefix"))


def test_a_restarted_engine_reads_the_agent_head_from_disk(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    cold, _ = answer(tiny_model_dir, "What is second?", prefix_cache_bytes=0)
    first, stats = answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    assert first.usage.cached_tokens == 0 and files(tmp_path)
    assert {s.name: s.on for s in stats.speedups}["prefix_disk"]
    second, stats = answer(tiny_model_dir, "What is second?", prefix_cache_dir=str(tmp_path))
    assert second.token_ids == cold.token_ids
    assert second.usage.cached_tokens > 100  # the system head, read back instead of prefilled
    assert stats.prefix_disk_hits == 1 and stats.prefix_disk_hit_tokens >= 100
    assert stats.prefix_disk_skipped == 0


def test_another_model_or_engine_version_never_reads_them(
        tiny_model_dir: Path, thinking_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    other, stats = answer(thinking_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    assert other.usage.cached_tokens == 0 and stats.prefix_disk_hits == 0
    assert stats.prefix_disk_skipped == 0  # not refused: never looked at (another key)
    monkeypatch.setattr(prefix_disk, "FORMAT", prefix_disk.FORMAT + 1)
    again, stats = answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    assert again.usage.cached_tokens == 0 and stats.prefix_disk_hits == 0


@pytest.mark.parametrize("damage", ["truncated", "altered", "garbage"])
def test_damaged_files_are_skipped_with_a_warning(tiny_model_dir: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  damage: str) -> None:
    cold, _ = answer(tiny_model_dir, "What is second?", prefix_cache_bytes=0)
    answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    for path in files(tmp_path):
        data = bytearray(path.read_bytes())
        if damage == "truncated":
            data = data[: len(data) // 2]
        elif damage == "altered":
            data[-100] ^= 0x01  # one bit of one value: only the checksum can tell
        else:
            data = bytearray(b"\x00" * 64)
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="engine"):
        second, stats = answer(tiny_model_dir, "What is second?", prefix_cache_dir=str(tmp_path))
    assert second.token_ids == cold.token_ids and second.usage.cached_tokens == 0
    assert stats.prefix_disk_skipped >= 1 and stats.prefix_disk_hits == 0
    assert any("skipping" in record.getMessage() for record in caplog.records)


def test_the_disk_holds_its_byte_cap(tiny_model_dir: Path, tmp_path: Path) -> None:
    answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(tmp_path))
    one_conversation = sum(path.stat().st_size for path in files(tmp_path))
    cap = one_conversation * 2
    with Engine(tiny_model_dir, EngineConfig(prefix_cache_dir=str(tmp_path / "capped"),
                                             prefix_cache_disk_bytes=cap)) as eng:
        for i in range(6):
            conv = [{"role": "system", "content": f"Agent {i}. {SYSTEM}"},
                    {"role": "user", "content": "Go."}]
            eng.submit(request_for(conv, greedy(8))).result(timeout=120)
    held = sum(path.stat().st_size for path in files(tmp_path / "capped"))
    assert 0 < held <= cap


def test_a_directory_that_cannot_hold_files_leaves_reuse_in_memory(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    first, stats = answer(tiny_model_dir, "What is first?", prefix_cache_dir=str(blocker))
    found = {s.name: s for s in stats.speedups}
    assert not found["prefix_disk"].on and found["prefix_reuse"].on
    assert "cannot use the directory" in found["prefix_disk"].detail
    assert first.finish_reason is not None
