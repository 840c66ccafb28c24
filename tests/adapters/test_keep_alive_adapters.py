"""keep_alive through the faces: ``engine_config={"keep_alive": ...}`` and each face's own
``keep_alive`` (Ollama's convention: seconds, 0 right after, negative kept loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_index.core.llms import ChatMessage

from mlx_providers import ChatMLXBatch, MLXBatchLLM
from tests.conftest import own_copy, wait_until

QUESTION = "What stays loaded?"


def unloaded(stats_of: object, times: int) -> None:
    wait_until(lambda: stats_of().unloads == times and not stats_of().loaded)  # type: ignore[operator]


def test_langchain_engine_config_and_its_own_keep_alive(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    chat = ChatMLXBatch(model=own_copy(tiny_model_dir, tmp_path / "tiny"), max_tokens=6,
                        engine_config={"keep_alive": 0})
    try:
        first = chat.invoke(QUESTION).content
        unloaded(chat.engine.stats, 1)
        kept = chat.model_copy(update={"keep_alive": -1})  # this face keeps it loaded
        assert kept.invoke(QUESTION).content == first
        stats = chat.engine.stats()
        assert (stats.loaded, stats.loads, stats.unloads) == (True, 2, 1)
        assert chat.invoke(QUESTION).content == first  # the engine's 0 again: unloads
        unloaded(chat.engine.stats, 2)
    finally:
        chat.engine.close()


async def test_llama_index_engine_config_and_its_own_keep_alive(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    llm = MLXBatchLLM(own_copy(tiny_model_dir, tmp_path / "tiny"), max_tokens=6,
                      engine_config={"keep_alive": 600})
    try:
        first = (await llm.achat([ChatMessage(role="user", content=QUESTION)])).message
        assert llm.engine.stats().loaded
        quick = MLXBatchLLM(llm.model, max_tokens=6, keep_alive=0)  # same engine, own face
        again = (await quick.achat([ChatMessage(role="user", content=QUESTION)])).message
        assert again.content == first.content
        unloaded(llm.engine.stats, 1)
    finally:
        llm.engine.close()


def test_a_face_keep_alive_is_a_number() -> None:
    with pytest.raises(ValueError):
        ChatMLXBatch(keep_alive="5m")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MLXBatchLLM(keep_alive=float("inf"))
