"""Sentence embeddings on the engine thread: tokenize, run BERT, mean-pool, normalise.

Texts longer than the model's ``max_seq_length`` (256 tokens for all-MiniLM-L6-v2,
counting [CLS] and [SEP]) are truncated there, as sentence-transformers does: the
embedding then describes the first 254 word pieces only. A batch is sorted by length and
cut into forwards of at most ``_TOKENS_PER_FORWARD`` padded tokens, so one long text does
not pad a hundred short ones to its length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from engine.device.embedding.bert import Bert, load_bert

_TOKENS_PER_FORWARD = 8192  # bounds the attention scores one forward holds


@dataclass(frozen=True)
class Encoded:
    """Unit vectors (rows of ``vectors``, float32) and each text's tokens after truncation."""

    vectors: np.ndarray
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class _Pooling:
    mode: str  # "mean" or "cls"
    normalize: bool
    max_seq_length: int


def _pooling(path: Path, limit: int) -> _Pooling:
    """Pooling, normalisation and length from sentence-transformers' files (MiniLM's if
    absent: mean pooling, normalised, at most the model's positions)."""
    mode, normalize, max_len = "mean", True, limit
    pooling = path / "1_Pooling" / "config.json"
    if pooling.is_file():
        config = json.loads(pooling.read_text())
        if config.get("pooling_mode_cls_token"):
            mode = "cls"
        elif not config.get("pooling_mode_mean_tokens", True):
            raise ValueError(f"{pooling}: only mean or CLS pooling is supported")
    modules = path / "modules.json"
    if modules.is_file():
        kinds = [m.get("type", "") for m in json.loads(modules.read_text())]
        normalize = any(kind.endswith("Normalize") for kind in kinds)
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = int(json.loads(st_config.read_text()).get("max_seq_length", limit))
    return _Pooling(mode, normalize, min(max_len, limit))


class Encoder:
    """One embedding model, loaded and run on the engine thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: Bert = load_bert(path)
        self.pooling = _pooling(path, self.model.shape.max_position_embeddings)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()  # padding is ours, per forward
        self.tokenizer.enable_truncation(self.pooling.max_seq_length)
        self.dimensions = self.model.shape.hidden_size
        # Its weights count in the engine's memory formula beside the chat model's.
        params: list[tuple[str, mx.array]] = tree_flatten(self.model.parameters())  # type: ignore[assignment]
        self.nbytes: int = sum(int(array.nbytes) for _, array in params)

    @property
    def max_seq_length(self) -> int:
        return self.pooling.max_seq_length

    def encode(self, texts: list[str]) -> Encoded:
        """One unit vector per text (zero texts give a ``[0, dim]`` array)."""
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]
        out = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        start = 0
        while start < len(order):
            end = start + 1
            longest = len(ids[order[start]])
            while end < len(order):  # sorted: the last one taken is the longest
                longest = len(ids[order[end]])
                if longest * (end + 1 - start) > _TOKENS_PER_FORWARD:
                    break
                end += 1
            chunk = order[start:end]
            out[chunk] = self._forward([ids[i] for i in chunk])
            start = end
        return Encoded(out, tuple(len(one) for one in ids))

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(one) for one in batch)
        padded = np.zeros((len(batch), width), dtype=np.int32)
        valid = np.zeros((len(batch), width), dtype=np.float32)
        for row, one in enumerate(batch):
            padded[row, : len(one)] = one
            valid[row, : len(one)] = 1.0
        mask = mx.array(valid)
        hidden = self.model(mx.array(padded), mask)
        if self.pooling.mode == "cls":
            pooled = hidden[:, 0, :]
        else:  # the mean over real tokens only: padding is weighted out
            weights = mask[:, :, None]
            pooled = (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9)
        if self.pooling.normalize:
            norm = mx.sqrt((pooled * pooled).sum(axis=-1, keepdims=True))
            pooled = pooled / mx.maximum(norm, 1e-12)
        return np.array(pooled.astype(mx.float32))
