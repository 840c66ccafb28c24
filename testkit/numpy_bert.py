"""An independent sentence-embedding reference in plain numpy, for checking the MLX encoder.

It reads the same safetensors and tokenizer but shares no code with ``engine.device``:
one sentence at a time (no padding, so no mask to get wrong), float64 throughout,
erf-GELU, mean pooling and L2 normalisation as sentence-transformers' MiniLM does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

_erf = np.vectorize(math.erf)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


class NumpyBert:
    """``embed(text)`` -> a unit vector (float64) for one sentence."""

    def __init__(self, path: Path, max_seq_length: int = 256) -> None:
        self.config = json.loads((path / "config.json").read_text())
        raw = load_file(str(path / "model.safetensors"))
        self.w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in raw.items()
                  if not k.endswith("position_ids")}
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_seq_length)

    def _linear(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]

    def _norm(self, name: str, x: np.ndarray) -> np.ndarray:
        eps = float(self.config.get("layer_norm_eps", 1e-12))
        return _layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], eps)

    def embed(self, text: str) -> np.ndarray:
        ids = np.array(self.tokenizer.encode(text).ids)
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][: len(ids)]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm("embeddings.LayerNorm", x)
        heads = self.config["num_attention_heads"]
        for n in range(self.config["num_hidden_layers"]):
            p = f"encoder.layer.{n}"
            q, k, v = (self._linear(f"{p}.attention.self.{m}", x).reshape(len(ids), heads, -1)
                       .transpose(1, 0, 2) for m in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = (scores / scores.sum(-1, keepdims=True)) @ v
            attn = attn.transpose(1, 0, 2).reshape(len(ids), -1)
            x = self._norm(f"{p}.attention.output.LayerNorm",
                           self._linear(f"{p}.attention.output.dense", attn) + x)
            h = self._linear(f"{p}.intermediate.dense", x)
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
            x = self._norm(f"{p}.output.LayerNorm", self._linear(f"{p}.output.dense", h) + x)
        pooled = x.mean(axis=0)
        return pooled / np.linalg.norm(pooled)
