"""What Ollama's model listings say about a model, read from its files (never loaded).

``/api/tags``, ``/api/show`` and ``/api/ps`` describe each model by its format, family,
size on disk, parameter count, quantization, modification time and digest, and ``show``
adds its context length, embedding width and chat template. A model directory's
``config.json``, its safetensors headers (the first bytes of each file: tensor shapes, no
weights) and its tokenizer config hold all of it; a GGUF file gives its size and time.

The digest is a SHA-256 of each weight file's name, size and modification time, not of
its bytes (hashing gigabytes per listing would stall the server): it changes when the
files do, which is what a client caching by digest needs. Facts are cached per path and
modification time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# MLX's float dtypes as Ollama names an unquantized model's "quantization level".
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is no header


@dataclass(frozen=True)
class ModelFacts:
    """One model's files, as the listings report them."""

    format: str  # "safetensors" or "gguf"
    family: str  # config.json's model_type ("qwen2", "gemma3", "bert"); "" when unknown
    size: int  # bytes of the weight files
    modified_at: str  # RFC 3339, the newest weight file's time
    digest: str
    parameter_count: int | None = None
    quantization_level: str = ""
    embedding_length: int | None = None  # the hidden width
    context_length: int | None = None  # as the files declare it
    template: str = ""  # the chat template (Jinja), "" when the files have none
    config: dict[str, Any] = field(default_factory=dict, compare=False)

    def details(self, parent: str = "") -> dict[str, Any]:
        """Ollama's ``details`` object."""
        return {"parent_model": parent, "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None,
                "parameter_size": parameter_size(self.parameter_count),
                "quantization_level": self.quantization_level}


def parameter_size(count: int | None) -> str:
    """A parameter count as Ollama writes it: "135.0M", "7.6B"."""
    if not count:
        return ""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def model_facts(path: Path) -> ModelFacts:
    """The facts of a model directory or GGUF file (cached until its files change)."""
    files = _weight_files(path)
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _facts(str(path), stamp)


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))


@functools.lru_cache(maxsize=64)
def _facts(where: str, stamp: tuple[tuple[str, int, int], ...]) -> ModelFacts:
    path = Path(where)
    digest = hashlib.sha256(repr(stamp).encode()).hexdigest()
    size = sum(s for _, s, _ in stamp)
    newest = max((t for _, _, t in stamp), default=0)
    modified = datetime.fromtimestamp(newest / 1e9, timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    if not stamp:  # no weight files here (a stand-in engine's path): nothing to say
        return ModelFacts("", "", 0, modified, digest)
    if path.is_file() or stamp[0][0].endswith(".gguf"):
        return ModelFacts("gguf", "", size, modified, digest)
    config = _json(path / "config.json")
    nested = config.get("text_config")  # a vision model's language model
    text: dict[str, Any] = nested if isinstance(nested, dict) else {}
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    dtype = config.get("torch_dtype") or text.get("torch_dtype") or ""
    level = f"Q{bits}" if isinstance(bits, int) else _DTYPES.get(str(dtype), str(dtype).upper())
    return ModelFacts(
        "safetensors", str(config.get("model_type") or ""), size, modified, digest,
        _parameter_count([path / name for name, _, _ in stamp],
                         bits if isinstance(bits, int) else None),
        level, _int(config.get("hidden_size") or text.get("hidden_size")),
        _int(_json(path / "sentence_bert_config.json").get("max_seq_length")
             or config.get("max_position_embeddings")
             or text.get("max_position_embeddings")),
        _chat_template(path), config)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _parameter_count(files: list[Path], bits: int | None) -> int | None:
    """Parameters from the safetensors headers; a quantized weight packs 32 / bits values
    in each uint32 and its scales and biases are not parameters."""
    total = 0
    for file in files:
        try:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > _HEADER_LIMIT:
                    return None
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error):
            return None
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            if bits and name.endswith((".scales", ".biases")):
                continue
            count = math.prod(info.get("shape") or [1])
            if bits and info.get("dtype") == "U32":
                count = count * 32 // bits
            total += count
    return total or None


def _chat_template(path: Path) -> str:
    """The chat template the files carry: chat_template.jinja, else tokenizer_config's
    (its default, when it holds several by name)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    return template if isinstance(template, str) else ""
