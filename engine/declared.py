"""What a model declares about itself, read without loading, converting or downloading it.

A face describes its model before the first request (LangChain reads a chat model's
profile when middleware is built): the context limit the model declares and whether its
tokenizer has reasoning markers. Both come from files already on this machine: a model
directory's ``config.json`` and ``tokenizer.json``, a GGUF file's header (no tensors are
read), the default model's GGUF where it is installed or cached, a hub id's cached config.
Anything else is unknown (None), never a download; the loaded engine knows the rest.
Reasoning is read against the token pairs the dialects declare (``Dialect.reasoning_tokens``),
so it lives above both the model files (``engine.models``) and the dialects.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.default_model import default_model_gguf_here
from engine.models.gguf import read_header
from engine.models.resolve import config_context_limit, looks_like_path
from engine.requests.dialects.registry import reasoning_tokens
from engine.requests.inbound.vision_formats import (
    AUDIO_FAMILIES,
    SUPPORTED,
    VIDEO_FAMILIES,
    is_vision_config,
)


@dataclass(frozen=True)
class DeclaredModel:
    """A model's own declarations; None where they cannot be read without loading it."""

    context_limit: int | None = None
    reasoning: bool | None = None  # its tokenizer marks reasoning (a thinking model)
    image_inputs: bool = False  # a vision checkpoint of a family whose images are read
    video_inputs: bool = False  # ... whose videos are read too (the Qwen-VL families)
    audio_inputs: bool = False  # ... whose audio is read too (Gemma 4 with an audio tower)


def declared_model(spec: str | os.PathLike[str] | None) -> DeclaredModel:
    """What ``spec`` (a model directory, a ``.gguf``, a hub id, None for the default
    model) declares, from local files only; never raises for a model it cannot read."""
    try:
        source = _local_source(spec)
        if source is None:
            return DeclaredModel()
        if source.is_dir():
            images = _dir_images(source)
            return DeclaredModel(config_context_limit(source), _dir_reasoning(source),
                                 images, images and _dir_videos(source),
                                 images and _dir_audio(source))
        header = read_header(source)
        limit = header.arch_value("context_length")
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        return DeclaredModel(limit if isinstance(limit, int) and limit > 0 else None,
                             _marks_reasoning(tokens) if isinstance(tokens, list) else None)
    except (OSError, ValueError):  # unreadable here: loading it will name the problem
        return DeclaredModel()


def _local_source(spec: str | os.PathLike[str] | None) -> Path | None:
    """The directory or GGUF file ``spec`` names that is already on this machine."""
    if spec is None:
        return default_model_gguf_here()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if path.exists() or looks_like_path(text):
        return None
    return _hub_cache_dir(text)


def _hub_cache_dir(repo_id: str) -> Path | None:
    """A hub model's snapshot directory, when its config is already in the local cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def _dir_images(path: Path) -> bool:
    """The checkpoint has a vision tower of a family whose images are read, and mlx-vlm
    (the ``vision`` extra) is installed to run it."""
    config_path = path / "config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return (isinstance(config, dict) and is_vision_config(config)
            and config.get("model_type") in SUPPORTED
            and importlib.util.find_spec("mlx_vlm") is not None)


def _dir_videos(path: Path) -> bool:
    """The checkpoint's family reads videos (a video token and a family that has them)."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return config.get("model_type") in VIDEO_FAMILIES and "video_token_id" in config


def _dir_audio(path: Path) -> bool:
    """The checkpoint's family reads audio and the checkpoint has an audio tower."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return (config.get("model_type") in AUDIO_FAMILIES
            and isinstance(config.get("audio_config"), dict))


def _dir_reasoning(path: Path) -> bool | None:
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        return None
    data: Any = json.loads(tokenizer.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab", {}) if isinstance(data, dict) else {}
    added = [t.get("content") for t in data.get("added_tokens", ()) if isinstance(t, dict)]
    return _marks_reasoning({*(vocab if isinstance(vocab, dict) else ()), *added})


def _marks_reasoning(tokens: Iterable[Any]) -> bool:
    vocab: Collection[Any] = tokens if isinstance(tokens, set) else set(tokens)
    return any(start in vocab and end in vocab for start, end in reasoning_tokens())
