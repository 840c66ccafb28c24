"""A few seconds of fitting that make a tiny model write given completions, greedily.

``fit_to_transcripts`` trains every weight with Adam on the completion tokens only, until
each completion token is the argmax after its prefix (teacher forcing): greedy decoding of
the prompt then writes the completion exactly. Logits are computed only at completion
positions where the model is backbone + head (the head over a 150k-262k vocabulary is most
of the work), else from the whole forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Transcript:
    """Token ids: a prompt and the completion the model must learn to write after it."""

    prompt: list[int]
    completion: list[int]


def _head(model: Any) -> Any | None:
    """The output head of a backbone + head model (tied or not), or None."""
    language = getattr(model, "language_model", model)
    backbone = getattr(language, "model", None)
    if backbone is None or not hasattr(backbone, "embed_tokens"):
        return None
    if hasattr(language, "lm_head"):
        return language.lm_head
    return backbone.embed_tokens.as_linear


def _batch(transcripts: Sequence[Transcript]) -> tuple[Any, Any, Any]:
    """Right-padded inputs, the flat positions that predict completion tokens, the targets."""
    import mlx.core as mx

    width = max(len(t.prompt) + len(t.completion) for t in transcripts) - 1
    inputs, positions, targets = [], [], []
    for row, t in enumerate(transcripts):
        ids = t.prompt + t.completion
        inputs.append(ids[:-1] + [0] * (width - len(ids) + 1))
        for j in range(len(t.prompt) - 1, len(ids) - 1):
            positions.append(row * width + j)
            targets.append(ids[j + 1])
    return mx.array(inputs), mx.array(positions), mx.array(targets)


def fit_to_transcripts(model_dir: Path, transcripts: Sequence[Transcript], *,
                       max_steps: int = 400, learning_rate: float = 3e-3) -> int:
    """Fit the model in ``model_dir`` (overwritten) to the transcripts; the steps it took.

    Raises ``RuntimeError`` if ``max_steps`` pass before greedy decoding reproduces every
    completion.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.utils import load_model, save_model

    model, _ = load_model(model_dir)
    inputs, positions, targets = _batch(transcripts)
    head = _head(model)

    def logits_at(m: Any) -> Any:
        if head is None:
            full = m(inputs)
            return full.reshape(-1, full.shape[-1])[positions]
        hidden = getattr(m, "language_model", m).model(inputs)
        return _head(m)(hidden.reshape(-1, hidden.shape[-1])[positions])  # type: ignore[misc]

    def loss_fn(m: Any) -> Any:
        return nn.losses.cross_entropy(logits_at(m), targets, reduction="mean")

    optimizer = optim.Adam(learning_rate=learning_rate)
    step = nn.value_and_grad(model, loss_fn)
    for n in range(1, max_steps + 1):
        _, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        if n % 10 == 0 and bool(mx.all(mx.argmax(logits_at(model), axis=-1) == targets)):
            for old in model_dir.glob("model*.safetensors"):
                old.unlink()  # a hard-linked copy must not write through to its source
            save_model(model_dir, model)
            return n
    raise RuntimeError(f"{max_steps} steps did not make greedy decoding write the completions")
