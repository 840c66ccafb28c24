"""Model resolution: turn a model spec into a local directory that ``mlx_lm.load`` accepts.

A spec is one of:

- ``None``: the default model, SmolLM2-135M-Instruct (``engine.models.default_model``),
  converted once like any GGUF;
- a path to a ``.gguf`` file: converted once by :mod:`engine.models.gguf` and cached
  (``engine.models.user_cache``);
- a path to a model directory: returned as is;
- anything else: a Hugging Face Hub id, fetched with mlx-lm's own download helper.

Also the context length a model directory's config declares. ``mlx`` is imported only
inside functions: another module must load a BLAS library before ``mlx.core`` is first
imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.errors import InvalidModelError, ModelDownloadError
from engine.models.default_model import default_model_gguf
from engine.models.user_cache import converted_gguf_dir, on_accelerator

__all__ = [
    "config_context_limit",
    "from_hub",
    "looks_like_path",
    "model_path_for",
    "prefer_quantized",
    "resolve_model",
    "text_configs",
]


def prefer_quantized() -> bool:
    """Whether the default backend runs quantized weights well: Metal, CUDA, or the CPU with
    this package's kernels (engine.device.kernels.cpu_kernels).

    MLX's own CPU ops run only float32 matmuls through BLAS: there bf16 and 4-bit run 2-6x
    slower than float32, so without the kernels the CPU default is to dequantize.
    """
    from engine.device.loading.weights import cpu_kernels_available

    return on_accelerator() or cpu_kernels_available()


def looks_like_path(spec: str) -> bool:
    """Specs that can only mean a local path: never sent to the hub when missing."""
    return (
        spec.startswith(("/", ".", "~", os.sep))
        or spec.endswith(".gguf")
        or (Path(spec).is_absolute())
    )


def _model_dir(path: Path) -> Path:
    """``path`` itself if it holds a ``config.json``; else a clear ``InvalidModelError``."""
    if not (path / "config.json").is_file():
        raise InvalidModelError(
            f"{path} is not a model directory: it has no config.json "
            "(expected a Hugging Face / mlx-lm model directory, or pass a .gguf file)"
        )
    return path


def from_hub(repo_id: str) -> Path:
    """A hub snapshot directory; mlx-lm (hence mlx) is imported only when one is asked for."""
    from engine.device.loading.weights import download_from_hub

    try:
        path = download_from_hub(repo_id)
    except Exception as exc:  # hub errors vary: offline, not found, invalid id, auth
        raise ModelDownloadError(
            f"{repo_id!r} is not a local path, so it was fetched from the Hugging Face Hub, "
            f"which failed: {exc}"
        ) from exc
    return _model_dir(path)


def resolve_model(
    spec: str | os.PathLike[str] | None = None, *, quantized: bool | None = None
) -> Path:
    """A local directory that ``mlx_lm.load`` accepts for ``spec``.

    ``quantized`` applies to GGUF conversions: True keeps the file's 4/8-bit weights, False
    writes float32; None picks by backend (quantized on Metal and CUDA, and on the CPU where
    this package's CPU kernels run; float32 on the CPU without them).
    A missing path that looks like one (starting with ``/ . ~`` or ending ``.gguf``) raises
    ``FileNotFoundError`` rather than being tried on the hub.
    """
    if spec is None:
        gguf_path = default_model_gguf()
    else:
        text = os.fspath(spec)
        path = Path(text).expanduser()
        if path.is_dir():
            return _model_dir(path)
        if not path.exists():
            if isinstance(spec, os.PathLike) or looks_like_path(text):
                raise FileNotFoundError(f"model path {text!r} does not exist")
            return from_hub(text)
        if path.suffix.lower() != ".gguf":
            raise InvalidModelError(
                f"{text} is a file but not a .gguf; pass a .gguf file or a model directory"
            )
        gguf_path = path
    keep = prefer_quantized() if quantized is None else quantized
    return converted_gguf_dir(gguf_path, quantized=keep)


def model_path_for(spec: str | os.PathLike[str] | None, quantized: bool | None) -> Path:
    """What the engine loads for ``spec``: a local model directory as it is, else
    ``resolve_model`` (the default model, a GGUF conversion, a hub id)."""
    if spec is not None and Path(spec).is_dir():
        return Path(spec)  # a local model directory needs no resolution
    return resolve_model(spec, quantized=quantized)


# Where configs state the context length: HF's name, GPT-2's and a few others'.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                 "seq_length", "max_sequence_length", "model_max_length")
# Where multimodal wrappers keep their language model's config (mlx-lm reads text_config).
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


def text_configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The configs that describe the language model, the nested text config first."""
    nested = [config[key] for key in _TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    return [*nested, config]


def config_context_limit(model_path: Path) -> int | None:
    """The context length a model directory's config.json declares, if any.

    A wrapper's text config wins over its top level: the language model is what decodes.
    A config that cannot be read gives None here; loading the model names that error.
    """
    try:
        config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for part in text_configs(config):
        for name in _CONTEXT_KEYS:
            value = part.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
