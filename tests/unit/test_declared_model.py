"""What a model declares, read from its files without loading it (``engine.declared_model``)."""

from __future__ import annotations

import json
from pathlib import Path

from engine import DeclaredModel, declared_model


def _model_dir(root: Path, config: dict, tokens: list[str]) -> Path:  # type: ignore[type-arg]
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {"a": 0, "b": 1}},
        "added_tokens": [{"id": 2 + i, "content": t} for i, t in enumerate(tokens)]}))
    return root


def test_a_directory_declares_its_context_and_reasoning_markers(tmp_path: Path) -> None:
    plain = _model_dir(tmp_path / "plain", {"max_position_embeddings": 4096}, ["<|im_end|>"])
    thinking = _model_dir(tmp_path / "thinking", {"text_config": {"max_position_embeddings": 512}},
                          ["<think>", "</think>"])
    assert declared_model(plain) == DeclaredModel(4096, False)
    assert declared_model(str(thinking)) == DeclaredModel(512, True)


def test_what_is_not_on_this_machine_is_unknown_never_fetched(tmp_path: Path) -> None:
    assert declared_model(tmp_path / "missing") == DeclaredModel()
    assert declared_model("nobody/not-a-cached-model") == DeclaredModel()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    assert declared_model(broken) == DeclaredModel()
