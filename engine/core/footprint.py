"""What a model's KV cache costs: pure numbers the scheduler budgets with (no mlx).

Runner-side adapters (``cache_layout``) describe each cache layer once at load time;
from then on admission is arithmetic on these records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerFootprint:
    """One cache layer: its bytes for n tokens, its token limit, whether rows can merge."""

    kind: str
    batchable: bool
    bytes_per_token: int = 0
    fixed_bytes: int = 0
    window: int | None = None
    token_limit: int | None = None

    def bytes_for(self, n_tokens: int) -> int:
        held = n_tokens if self.window is None else min(n_tokens, self.window)
        return self.fixed_bytes + self.bytes_per_token * held


@dataclass(frozen=True)
class ModelFootprint:
    """All cache layers of a model plus the context limit from its config.

    ``unbatchable`` names what, beyond the cache types, keeps rows from sharing a batch
    (a model whose layers read the left padding of a batched prefill).
    """

    layers: tuple[LayerFootprint, ...]
    config_limit: int | None = None
    unbatchable: tuple[str, ...] = ()

    @classmethod
    def of(cls, layers: Sequence[LayerFootprint], config_limit: int | None,
           unbatchable: Sequence[str] = ()) -> ModelFootprint:
        return cls(tuple(layers), config_limit, tuple(unbatchable))

    @property
    def batchable(self) -> bool:
        return not self.unbatchable and all(layer.batchable for layer in self.layers)

    @property
    def non_batchable_kinds(self) -> tuple[str, ...]:
        kinds = {layer.kind for layer in self.layers if not layer.batchable}
        return tuple(sorted(kinds | set(self.unbatchable)))

    @property
    def context_limit(self) -> int | None:
        """The smallest limit any cache layer or the model config allows."""
        limits = [layer.token_limit for layer in self.layers if layer.token_limit is not None]
        if self.config_limit is not None:
            limits.append(self.config_limit)
        return min(limits) if limits else None

    def bytes_for(self, n_tokens: int) -> int:
        """Worst-case bytes one row holds after n tokens (prompt + generated)."""
        return sum(layer.bytes_for(n_tokens) for layer in self.layers)
