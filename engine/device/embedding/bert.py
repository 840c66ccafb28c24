"""A BERT encoder in MLX: the transformer that sentence-transformers models pool.

Module names follow the Hugging Face checkpoint (``embeddings.word_embeddings``,
``encoder.layer.N.attention.self.query``...), so its safetensors load without renaming.
Padding is masked out of attention with an additive mask; pooling happens elsewhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class BertShape:
    """The config.json fields the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def read(cls, path: Path) -> BertShape:
        """The shape from ``path/config.json``; a model that is not BERT-like is refused."""
        config = json.loads((path / "config.json").read_text())
        kind = config.get("model_type")
        if kind not in ("bert", None):
            raise ValueError(f"{path} holds a {kind!r} model; the encoder runs BERT models")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {config['hidden_act']!r} is not supported")
        return cls(**{name: config[name] for name in cls.__dataclass_fields__
                      if name in config})


class _Embeddings(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position_embeddings = nn.Embedding(shape.max_position_embeddings, shape.hidden_size)
        self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, shape.hidden_size)
        self.LayerNorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :]
        # Single-sentence inputs: every token is of type 0.
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(mx.zeros_like(ids)))
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.heads = shape.num_attention_heads
        self.query = nn.Linear(shape.hidden_size, shape.hidden_size)
        self.key = nn.Linear(shape.hidden_size, shape.hidden_size)
        self.value = nn.Linear(shape.hidden_size, shape.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, width = x.shape
        head = width // self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, head).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(head),
                                                   mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class _DenseNorm(nn.Module):
    """A projection back to the hidden width, then the residual and LayerNorm."""

    def __init__(self, inner: int, shape: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, shape.hidden_size)
        self.LayerNorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        setattr(self, "self", _SelfAttention(shape))  # noqa: B010 - the checkpoint's name
        self.output = _DenseNorm(shape.hidden_size, shape)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        attend: _SelfAttention = self["self"]
        return self.output(attend(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(shape.hidden_size, shape.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return nn.gelu(self.dense(x))  # BERT's "gelu" is the exact (erf) one


class _Layer(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.attention = _Attention(shape)
        self.intermediate = _Intermediate(shape)
        self.output = _DenseNorm(shape.intermediate_size, shape)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.layer = [_Layer(shape) for _ in range(shape.num_hidden_layers)]


class Bert(nn.Module):
    """Token ids and a padding mask in, one hidden state per token out."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.shape = shape
        self.embeddings = _Embeddings(shape)
        self.encoder = _Encoder(shape)

    def __call__(self, ids: mx.array, valid: mx.array) -> mx.array:
        """``ids`` and ``valid`` (1 for tokens, 0 for padding) are ``[batch, length]``."""
        # A boolean key mask: no token attends to padding (padding rows are pooled away).
        mask = valid.astype(mx.bool_)[:, None, None, :]
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def load_bert(path: Path) -> Bert:
    """BERT weights from ``path`` (``model.safetensors``), with or without a ``bert.`` prefix.

    The pooler and the checkpoint's ``position_ids`` buffer are not needed for embeddings.
    """
    model = Bert(BertShape.read(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights")
    weights: dict[str, Any] = {}
    for file in files:
        loaded = mx.load(str(file))
        assert isinstance(loaded, dict)
        weights.update(loaded)
    kept = {_strip(name): value for name, value in weights.items()
            if _strip(name).startswith(("embeddings.", "encoder."))
            and not name.endswith("position_ids")}
    model.load_weights(list(kept.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _strip(name: str) -> str:
    return name.removeprefix("bert.")
