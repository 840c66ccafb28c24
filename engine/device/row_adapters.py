"""Many LoRA adapters on one base model, in one batch: each row its own low-rank delta.

An adapter is mlx-lm's (``mlx_lm.lora`` writes ``adapter_config.json`` and
``adapters.safetensors``): low-rank ``lora_a`` (in, r) and ``lora_b`` (r, out) for some
linear layers, added as ``scale * (x @ lora_a) @ lora_b``. The base weights stay as loaded,
once. Each targeted linear is wrapped by a ``RowLoRALinear``, which reads the slots of the
rows in the forward now running (``RowAdapters.current``: slot 0 is the base) and adds each
row's own delta with one gathered low-rank product: ``x[b] @ A[slot[b]] @ B[slot[b]]``.
A forward whose rows all run the base adds nothing and costs nothing.

Loaded adapters sit in slots, least recently used first out, within ``max_bytes``; an
adapter a row uses is never evicted. The stacked ``A``/``B`` of each wrapped layer are
rebuilt when the set changes (ranks padded with zeros, which add nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import InvalidRequestError
from engine.requests.inbound.adapters import adapter_config


@dataclass
class Adapter:
    """One LoRA adapter: its low-rank pairs by the base model's module path."""

    name: str
    path: Path
    scale: float
    rank: int
    pairs: dict[str, tuple[mx.array, mx.array]]  # module path -> (lora_a, lora_b)
    users: int = 0  # rows using it now (never evicted while > 0)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes + b.nbytes) for a, b in self.pairs.values())


def read_adapter(path: Path, model: Any, name: str | None = None) -> Adapter:
    """Read and check an adapter directory against ``model``; a bad one is an
    ``InvalidRequestError`` naming what does not fit (nothing else is touched)."""
    where = str(path)
    lora = adapter_config(where)["lora_parameters"]
    loaded = mx.load(str(path / "adapters.safetensors"))
    assert isinstance(loaded, dict)
    weights: dict[str, mx.array] = loaded
    modules = dict(model.named_modules())
    pairs: dict[str, tuple[mx.array, mx.array]] = {}
    for key in sorted(weights):
        if not key.endswith(".lora_a"):
            if not key.endswith(".lora_b"):
                raise InvalidRequestError(f"adapter {where}: {key} is not a LoRA weight "
                                          "(lora_a, lora_b)", "adapter")
            continue
        module_path = key[: -len(".lora_a")]
        b_key = module_path + ".lora_b"
        base = modules.get(module_path)
        if base is None or b_key not in weights:
            raise InvalidRequestError(f"adapter {where}: {module_path} is not a layer of the "
                                      "base model" if base is None
                                      else f"adapter {where}: {b_key} is missing", "adapter")
        lora_a, lora_b = weights[key], weights[b_key]
        out_dims, in_dims = linear_dims(base)
        if lora_a.shape != (in_dims, lora_a.shape[1]) or lora_b.shape != (lora_a.shape[1],
                                                                           out_dims):
            raise InvalidRequestError(
                f"adapter {where}: {module_path} has lora_a {tuple(lora_a.shape)} and lora_b "
                f"{tuple(lora_b.shape)}, which do not fit the base layer ({in_dims} in, "
                f"{out_dims} out)", "adapter")
        pairs[module_path] = (lora_a, lora_b)
    if not pairs:
        raise InvalidRequestError(f"adapter {where}: no LoRA weights", "adapter")
    mx.eval([p for pair in pairs.values() for p in pair])
    return Adapter(name or path.name, path, float(lora["scale"]), int(lora["rank"]), pairs)


def linear_dims(layer: Any) -> tuple[int, int]:
    """(out, in) of a linear layer, quantized or not (a wrapped one: its base's)."""
    if isinstance(layer, RowLoRALinear):
        layer = layer.base
    out_dims, in_dims = layer["weight"].shape
    bits = getattr(layer, "bits", None)
    if "scales" in layer and bits:
        in_dims = in_dims * 32 // bits
    return int(out_dims), int(in_dims)


class RowLoRALinear(nn.Module):
    """A base linear plus each row's adapter delta (its slot's low-rank pair)."""

    def __init__(self, base: Any, path: str, adapters: RowAdapters) -> None:
        super().__init__()
        self.base = base
        self._path = path
        self._adapters = adapters

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self._adapters.current
        if slots is None:
            return y
        stacked = self._adapters.stacks.get(self._path)
        if stacked is None:  # no loaded adapter changes this layer
            return y
        a, b, scale = stacked
        # One gathered low-rank product for the batch: each row its own pair (slot 0: none).
        z = (x @ a[slots]) @ b[slots]
        return y + (scale[slots].reshape(-1, *([1] * (z.ndim - 1))) * z).astype(x.dtype)


@dataclass
class RowAdapters:
    """The adapters loaded on one model, in slots, and the slots of the rows running now."""

    model: Any
    max_bytes: int
    current: mx.array | None = None  # per row of the running forward; None: all base
    uid_slots: dict[int, int] = field(default_factory=dict)  # generator uid -> slot
    stacks: dict[str, tuple[mx.array, mx.array, mx.array]] = field(default_factory=dict)
    _slots: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)  # LRU order
    # Slot k+1 -> the adapter in it (None: free); a row keeps its slot while it runs.
    _order: list[str | None] = field(default_factory=list)
    _wrapped: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._slots.values())

    def names(self) -> list[str]:
        return list(self._slots)

    @property
    def in_use(self) -> int:
        """Rows holding an adapter now (each counted once per row)."""
        return sum(a.users for a in self._slots.values())

    def slot(self, name: str | None) -> int:
        """The slot of a loaded adapter (0: the base)."""
        return 0 if name is None else self._order.index(name) + 1

    def acquire(self, path: str) -> tuple[str, int]:
        """Load ``path`` (once) and hold it for a row: its name (the resolved path) and
        its slot."""
        key = str(Path(path).expanduser().resolve())
        adapter = self._slots.get(key)
        if adapter is None:
            adapter = read_adapter(Path(path).expanduser(), self.model, key)
            self._make_room(adapter.nbytes)
            self._slots[key] = adapter
            _route_batches()  # from the first adapter on, batch forwards read row slots
            self._restack()
        self._slots.move_to_end(key)
        adapter.users += 1
        return key, self.slot(key)

    def release(self, name: str) -> None:
        adapter = self._slots.get(name)
        if adapter is not None and adapter.users > 0:
            adapter.users -= 1

    def _make_room(self, nbytes: int) -> None:
        while self.nbytes + nbytes > self.max_bytes:
            idle = next((n for n, a in self._slots.items() if a.users == 0), None)
            if idle is None:
                raise InvalidRequestError(
                    f"adapters: {nbytes} more bytes do not fit in adapter_bytes="
                    f"{self.max_bytes} beside the adapters rows use now", "adapter")
            del self._slots[idle]
            self._order[self._order.index(idle)] = None
            self._restack()

    def _restack(self) -> None:
        """Each wrapped layer's stacked pairs, one per slot (a new adapter takes the first
        free slot; the others keep theirs)."""
        for name in self._slots:
            if name not in self._order:
                free = self._order.index(None) if None in self._order else len(self._order)
                self._order[free:free + 1] = [name]
        held = [self._slots[n] if n is not None else None for n in self._order]
        adapters = [a for a in held if a is not None]
        paths = sorted({p for a in adapters for p in a.pairs})
        self._wrap(paths)
        rank = max((a.rank for a in adapters), default=0)
        modules = dict(self.model.named_modules())
        self.stacks = {}
        for path in paths:
            out_dims, in_dims = linear_dims(modules[path])
            dtype = next(a.pairs[path][0].dtype for a in adapters if path in a.pairs)
            a_rows = [mx.zeros((in_dims, rank), dtype)]
            b_rows = [mx.zeros((rank, out_dims), dtype)]
            for adapter in held:
                pair = adapter.pairs.get(path) if adapter is not None else None
                if adapter is None or pair is None:
                    a_rows.append(mx.zeros((in_dims, rank), dtype))
                    b_rows.append(mx.zeros((rank, out_dims), dtype))
                    continue
                pad = rank - pair[0].shape[1]
                a_rows.append(mx.pad(pair[0], [(0, 0), (0, pad)]))
                b_rows.append(mx.pad(pair[1], [(0, pad), (0, 0)]))
            scale = mx.array([0.0] + [a.scale if a is not None and path in a.pairs else 0.0
                                      for a in held])
            self.stacks[path] = (mx.stack(a_rows), mx.stack(b_rows), scale)
        mx.eval(list(self.stacks.values()))

    def _wrap(self, paths: Sequence[str]) -> None:
        modules = dict(self.model.named_modules())
        fresh = [(p, RowLoRALinear(modules[p], p, self)) for p in paths
                 if p not in self._wrapped]
        if fresh:
            from mlx.utils import tree_unflatten

            self.model.update_modules(tree_unflatten(fresh))
            self._wrapped.update(p for p, _ in fresh)

    @contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """The forward inside runs these rows' slots (all base: nothing added)."""
        outer = self.current
        self.current = mx.array(list(slots), mx.int32) if any(slots) else None
        try:
            yield
        finally:
            self.current = outer


def adapters_of(model: Any) -> RowAdapters | None:
    """The adapters a lane's model serves (None: none attached)."""
    found = getattr(model, "_mlx_providers_adapters", None)
    return found if isinstance(found, RowAdapters) else None


@contextmanager
def rows_of(model: Any, slots: Sequence[int]) -> Iterator[None]:
    """Run the forward inside for rows of these slots (a model without adapters: as is)."""
    adapters = adapters_of(model)
    if adapters is None:
        yield
        return
    with adapters.rows(slots):
        yield


def attach(model: Any, max_bytes: int) -> RowAdapters:
    """Give ``model`` a set of per-row adapters; mlx-lm's batch forwards are routed through
    the slots of their rows (``uid_slots``) once the first adapter loads."""
    adapters = RowAdapters(model, max_bytes)
    model._mlx_providers_adapters = adapters
    return adapters


_routed = False


def _route_batches() -> None:
    """Wrap mlx-lm's batch forwards (prefill, decode) once per process: a batch whose model
    has adapters runs its rows' slots; any other runs as mlx-lm's."""
    global _routed
    if _routed:
        return
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

    from engine.device.grammar_step import LaneGenerationBatch

    for cls, name in ((GenerationBatch, "_step"), (LaneGenerationBatch, "_step"),
                      (PromptProcessingBatch, "prompt")):
        setattr(cls, name, _routed_method(getattr(cls, name)))
    _routed = True


def _routed_method(original: Any) -> Any:
    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        adapters = adapters_of(self.model)
        if adapters is None or not adapters.uid_slots:
            return original(self, *args, **kwargs)
        with adapters.rows([adapters.uid_slots.get(uid, 0) for uid in self.uids]):
            return original(self, *args, **kwargs)

    routed.__wrapped__ = original  # type: ignore[attr-defined]
    return routed
