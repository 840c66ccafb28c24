"""Many LoRA adapters on one base model, in one batch: each row its own low-rank delta.

An adapter is mlx-lm's (``mlx_lm.lora`` writes ``adapter_config.json`` and
``adapters.safetensors``): low-rank ``lora_a`` (in, r) and ``lora_b`` (r, out) for some
linear layers, added as ``scale * (x @ lora_a) @ lora_b``. The base weights stay as loaded,
once. Each targeted linear is wrapped by a ``RowLoRALinear``, which reads the slots of the
rows in the forward now running (``RowAdapters.current``: slot 0 is the base) and adds each
adapter row's own delta; base rows are left untouched. A forward whose rows all run the base
adds nothing and costs nothing.

Each wrapped layer holds the loaded adapters' pairs stacked by rank (``Group``: one stack per
distinct rank and dtype, no padding, no zero slot), which are the only copy of an adapter's
arrays. In a forward, a group whose rows all use one adapter adds plain matmuls on those rows
(mlx-lm's own LoRA product); a group with several runs one gathered product
(``mx.gather_mm``: no stacked weights are copied per row).

Loaded adapters sit in slots, least recently used first out, within ``max_bytes`` (the
stacks' real bytes); an adapter a row uses is never evicted. Loading is a transaction: the
new stacks and wrappers are built and checked first, and the state changes only once all
of it succeeded, so a bad adapter leaves the others exactly as they were.

Models that share the text model's layers by path (an image row's prefill runs through the
vision library's language model: ``RowAdapters.mirror``) get the same wrappers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import InvalidRequestError
from engine.requests.inbound.adapters import adapter_config

# The layers a per-row LoRA may wrap (the CPU kernels' linears subclass QuantizedLinear).
LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)


@dataclass(eq=False)
class Adapter:
    """One LoRA adapter: its low-rank pairs by the base model's module path (emptied once
    they are stacked: the stacks are then their only copy)."""

    name: str
    path: Path
    scale: float
    rank: int
    pairs: dict[str, tuple[mx.array, mx.array]]  # module path -> (lora_a, lora_b)
    nbytes: int = 0  # its pairs' bytes: what it adds to the stacks
    users: int = 0  # rows using it now (never evicted while > 0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(int(a.nbytes + b.nbytes) for a, b in self.pairs.values())


def read_adapter(path: Path, model: Any, name: str | None = None) -> Adapter:
    """Read and check an adapter directory against ``model``; a bad one is an
    ``InvalidRequestError`` naming what does not fit (nothing else is touched)."""
    where = str(path)
    lora = adapter_config(where)["lora_parameters"]
    rank = int(lora["rank"])
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
        base = _linear_at(modules, module_path, where)
        if b_key not in weights:
            raise InvalidRequestError(f"adapter {where}: {b_key} is missing", "adapter")
        lora_a, lora_b = weights[key], weights[b_key]
        out_dims, in_dims = linear_dims(base)
        if (lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] != in_dims
                or lora_b.shape != (lora_a.shape[1], out_dims)):
            raise InvalidRequestError(
                f"adapter {where}: {module_path} has lora_a {tuple(lora_a.shape)} and lora_b "
                f"{tuple(lora_b.shape)}, which do not fit the base layer ({in_dims} in, "
                f"{out_dims} out)", "adapter")
        if lora_a.shape[1] != rank:  # mlx-lm builds its layers at the config's rank
            raise InvalidRequestError(
                f"adapter {where}: {module_path} has rank {lora_a.shape[1]} (lora_a "
                f"{tuple(lora_a.shape)}), but adapter_config.json says rank {rank}", "adapter")
        if not all(mx.issubdtype(w.dtype, mx.floating) for w in (lora_a, lora_b)):
            raise InvalidRequestError(f"adapter {where}: {module_path}'s LoRA weights are not "
                                      "floating point", "adapter")
        pairs[module_path] = (lora_a, lora_b)
    if not pairs:
        raise InvalidRequestError(f"adapter {where}: no LoRA weights", "adapter")
    mx.eval([p for pair in pairs.values() for p in pair])
    return Adapter(name or path.name, path, float(lora["scale"]), rank, pairs)


def _linear_at(modules: dict[str, Any], path: str, where: str) -> Any:
    """The linear layer at ``path`` (a wrapped one: its base); anything else is refused."""
    base = modules.get(path)
    parent = modules.get(path.rpartition(".")[0])
    if base is None or isinstance(parent, RowLoRALinear):  # ``x.base``: not the model's own
        raise InvalidRequestError(f"adapter {where}: {path} is not a layer of the base model",
                                  "adapter")
    if isinstance(base, RowLoRALinear):
        base = base.base
    if not isinstance(base, LINEAR_TYPES):
        raise InvalidRequestError(
            f"adapter {where}: {path} is a {type(base).__name__}, not a linear layer (a "
            "per-row LoRA wraps only Linear and QuantizedLinear layers)", "adapter")
    return base


def linear_dims(layer: Any) -> tuple[int, int]:
    """(out, in) of a linear layer, quantized or not (a wrapped one: its base's)."""
    if isinstance(layer, RowLoRALinear):
        layer = layer.base
    out_dims, in_dims = layer["weight"].shape
    bits = getattr(layer, "bits", None)
    if "scales" in layer and bits:
        in_dims = in_dims * 32 // bits
    return int(out_dims), int(in_dims)


@dataclass(eq=False)
class Members:
    """The slots a group's stacks hold, in stack order, and their adapters' scales. Layers
    whose groups hold the same adapters share one (a forward plans it once)."""

    slots: tuple[int, ...]
    scales: tuple[float, ...]
    index: dict[int, int] = field(init=False)  # slot -> its place in the stacks

    def __post_init__(self) -> None:
        self.index = {slot: i for i, slot in enumerate(self.slots)}


@dataclass(frozen=True, eq=False)
class Group:
    """One layer's pairs of the adapters of one rank and dtype: ``a`` (n, in, r) and
    ``b`` (n, r, out), the pair of ``members.slots[i]`` at ``i``."""

    a: mx.array
    b: mx.array
    members: Members

    @property
    def kind(self) -> tuple[int, mx.Dtype, mx.Dtype]:
        return int(self.a.shape[-1]), self.a.dtype, self.b.dtype

    @property
    def nbytes(self) -> int:
        return int(self.a.nbytes + self.b.nbytes)


@dataclass(frozen=True, eq=False)
class Plan:
    """How one forward adds a group's deltas: to ``rows`` (None: every row), with the one
    stacked pair they all use (``single``) or each row's (``indices``)."""

    rows: mx.array | None
    single: int | None
    scale: float  # ``single``'s scale
    indices: mx.array | None = None  # (rows,) places in the stacks
    scales: mx.array | None = None  # (rows,)

    def add(self, x: mx.array, y: mx.array, group: Group) -> mx.array:
        """``y`` plus these rows' deltas of ``group``; other rows exactly as they are."""
        xs = x if self.rows is None else x[self.rows]
        if self.single is not None:
            # One adapter: mlx-lm's own product (LoRALinear), no gather.
            z = (xs @ group.a[self.single]) @ group.b[self.single]
            delta = (self.scale * z).astype(x.dtype)
        else:
            assert self.indices is not None and self.scales is not None
            z = mx.gather_mm(mx.gather_mm(xs, group.a, None, self.indices), group.b, None,
                             self.indices)
            delta = (self.scales.reshape(-1, *([1] * (z.ndim - 1))) * z).astype(x.dtype)
        return y + delta if self.rows is None else y.at[self.rows].add(delta)


class Forward:
    """The rows' slots of the forward now running, and its plan per group membership."""

    def __init__(self, slots: Sequence[int]) -> None:
        self.slots = tuple(slots)
        self._plans: dict[Members, Plan | None] = {}

    def plan(self, members: Members) -> Plan | None:
        """This forward's plan for groups holding ``members`` (None: no row uses them)."""
        if members in self._plans:
            return self._plans[members]
        rows = [i for i, slot in enumerate(self.slots) if slot in members.index]
        places = [members.index[self.slots[i]] for i in rows]
        plan = None
        if rows:
            subset = None if len(rows) == len(self.slots) else mx.array(rows, mx.uint32)
            if len(set(places)) == 1:
                plan = Plan(subset, places[0], members.scales[places[0]])
            else:
                plan = Plan(subset, None, 0.0, mx.array(places, mx.uint32),
                            mx.array([members.scales[p] for p in places], mx.float32))
        self._plans[members] = plan
        return plan


class RowLoRALinear(nn.Module):
    """A base linear plus each row's adapter delta (its slot's low-rank pair)."""

    def __init__(self, base: Any, path: str, adapters: RowAdapters) -> None:
        super().__init__()
        self.base = base
        self._path = path
        self._adapters = adapters

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        forward = self._adapters.current
        if forward is None:
            return y
        dtype = y.dtype
        for group in self._adapters.stacks.get(self._path, ()):
            plan = forward.plan(group.members)
            if plan is not None:
                y = plan.add(x, y, group)
        # The base's dtype stays (kv_dtype="float16": a k or v projection writes float16,
        # and a float32 product added to it would widen the rows' KV).
        return y if y.dtype == dtype else y.astype(dtype)


@dataclass
class RowAdapters:
    """The adapters loaded on one model, in slots, and the slots of the rows running now."""

    model: Any
    max_bytes: int
    current: Forward | None = None  # the running forward's rows; None: all base
    uid_slots: dict[int, int] = field(default_factory=dict)  # generator uid -> slot
    stacks: dict[str, tuple[Group, ...]] = field(default_factory=dict)  # by layer path
    _slots: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)  # LRU order
    # Slot k+1 -> the adapter in it (None: free); a row keeps its slot while it runs.
    _order: list[str | None] = field(default_factory=list)
    _wrapped: dict[str, RowLoRALinear] = field(default_factory=dict)
    # Models holding the text model's layers by path: (model, the path prefix it mirrors).
    _mirrors: list[tuple[Any, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes the loaded adapters hold: their stacked pairs (their only copy)."""
        return sum(g.nbytes for groups in self.stacks.values() for g in groups)

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
        its slot. A load that fails changes nothing."""
        key = str(Path(path).expanduser().resolve())
        adapter = self._slots.get(key)
        if adapter is None:
            adapter = read_adapter(Path(path).expanduser(), self.model, key)
            self._load(key, adapter)
        self._slots.move_to_end(key)
        adapter.users += 1
        return key, self.slot(key)

    def release(self, name: str) -> None:
        adapter = self._slots.get(name)
        if adapter is not None and adapter.users > 0:
            adapter.users -= 1

    def mirror(self, module: Any, source: Any) -> None:
        """Serve ``module``, which holds ``source``'s layers (a submodule of this model) by
        the same paths, with the same wrappers: its forwards inside ``rows`` add the rows'
        adapters too. Layers wrapped already are wrapped there at once, so a later
        ``_share_weights(module, source)`` finds the same parameter names on both."""
        prefix = next((name for name, m in self.model.named_modules() if m is source), None)
        if prefix is None:
            raise ValueError(f"{type(source).__name__} is not a part of the adapters' model")
        entry = (module, prefix + "." if prefix else "")
        _install([(mirror, theirs, wrapper) for path, wrapper in self._wrapped.items()
                  for mirror, theirs in self._mirror_paths(path, [entry])])
        self._mirrors.append(entry)

    def _load(self, key: str, adapter: Adapter) -> None:
        """Make room for ``adapter``, stack it and wrap its layers, or change nothing."""
        victims = self._victims(adapter.nbytes)
        order = [None if name in victims else name for name in self._order]
        free = order.index(None) if None in order else len(order)
        order[free:free + 1] = [key]
        dropped = {self.slot(name) for name in victims}
        stacks = self._stacked(adapter, free + 1, dropped)
        targets = self._wrappers(sorted(adapter.pairs))
        # Everything that could fail is done: commit (nothing below raises).
        for name in victims:
            del self._slots[name]
        self._slots[key] = adapter
        self._order = order
        self.stacks = stacks
        _install(targets)
        self._wrapped.update((path, w) for model, path, w in targets if model is self.model)
        adapter.pairs = {}  # its arrays live in the stacks now

    def _victims(self, nbytes: int) -> list[str]:
        """The idle adapters to evict, least recently used first, for ``nbytes`` more."""
        held = self.nbytes
        victims: list[str] = []
        idle = (name for name, a in self._slots.items() if a.users == 0)
        while held + nbytes > self.max_bytes:
            name = next(idle, None)
            if name is None:
                raise InvalidRequestError(
                    f"adapters: {nbytes} more bytes do not fit in adapter_bytes="
                    f"{self.max_bytes} beside the adapters rows use now", "adapter")
            victims.append(name)
            held -= self._slots[name].nbytes
        return victims

    def _stacked(self, adapter: Adapter, slot: int, dropped: set[int],
                 ) -> dict[str, tuple[Group, ...]]:
        """The stacks with ``adapter`` in ``slot`` and without the ``dropped`` slots, as new
        arrays (evaluated); groups neither touches are kept as they are."""
        shared: dict[tuple[tuple[int, ...], tuple[float, ...]], Members] = {}
        for groups in self.stacks.values():
            for group in groups:
                members = group.members
                shared.setdefault((members.slots, members.scales), members)
        stacks: dict[str, tuple[Group, ...]] = {}
        for path in sorted(set(self.stacks) | set(adapter.pairs)):
            pair = adapter.pairs.get(path)
            kind = (adapter.rank, pair[0].dtype, pair[1].dtype) if pair is not None else None
            rebuilt: list[Group] = []
            for group in self.stacks.get(path, ()):
                joins = pair is not None and group.kind == kind
                if not joins and not dropped & set(group.members.slots):
                    rebuilt.append(group)
                    continue
                kept = [(s, group.a[i], group.b[i], c) for i, (s, c) in
                        enumerate(zip(group.members.slots, group.members.scales))
                        if s not in dropped]
                if joins:
                    assert pair is not None
                    kept.append((slot, *pair, adapter.scale))
                    pair = None
                if kept:
                    rebuilt.append(_group(kept, shared))
            if pair is not None:  # the first adapter of its rank on this layer
                rebuilt.append(_group([(slot, *pair, adapter.scale)], shared))
            if rebuilt:
                stacks[path] = tuple(rebuilt)
        mx.eval([(g.a, g.b) for groups in stacks.values() for g in groups])
        return stacks

    def _wrappers(self, paths: Sequence[str]) -> list[tuple[Any, str, RowLoRALinear]]:
        """(model, path, wrapper) for each layer of ``paths`` not wrapped yet, here and in
        the mirrors; a mirror that lacks one of them refuses the adapter."""
        modules = dict(self.model.named_modules())
        fresh = [(p, RowLoRALinear(modules[p], p, self)) for p in paths
                 if p not in self._wrapped]
        targets: list[tuple[Any, str, RowLoRALinear]] = [(self.model, p, w) for p, w in fresh]
        for path, wrapper in fresh:
            targets += [(m, p, wrapper) for m, p in self._mirror_paths(path, self._mirrors)]
        return targets

    def _mirror_paths(self, path: str, mirrors: list[tuple[Any, str]],
                      ) -> list[tuple[Any, str]]:
        """Where ``path``'s layer sits in the mirrors under whose prefix it is; a mirror
        without a linear of the same shape there refuses the adapter."""
        found = []
        for mirror, prefix in mirrors:
            if not path.startswith(prefix):
                continue
            theirs: Any = dict(mirror.named_modules()).get(path[len(prefix):])
            ours: Any = (self._wrapped[path] if path in self._wrapped
                         else _module_at(self.model, path))
            theirs = theirs.base if isinstance(theirs, RowLoRALinear) else theirs
            ours = ours.base if isinstance(ours, RowLoRALinear) else ours
            # The wrapper replaces their layer, whose weights are (or will be) ours.
            if (not isinstance(theirs, LINEAR_TYPES)
                    or theirs["weight"].shape != ours["weight"].shape):
                raise InvalidRequestError(
                    f"adapters: {path} has no like layer in {type(mirror).__name__} (as "
                    f"{path[len(prefix):]}), which runs image rows", "adapter")
            found.append((mirror, path[len(prefix):]))
        return found

    @contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """The forward inside runs these rows' slots (all base: nothing added)."""
        outer = self.current
        self.current = Forward(slots) if any(slots) else None
        try:
            yield
        finally:
            self.current = outer


def _group(kept: list[tuple[int, mx.array, mx.array, float]],
           shared: dict[tuple[tuple[int, ...], tuple[float, ...]], Members]) -> Group:
    """A group of (slot, lora_a, lora_b, scale), stacked; equal memberships shared."""
    slots = tuple(s for s, _, _, _ in kept)
    scales = tuple(c for _, _, _, c in kept)
    members = shared.setdefault((slots, scales), Members(slots, scales))
    return Group(mx.stack([a for _, a, _, _ in kept]), mx.stack([b for _, _, b, _ in kept]),
                 members)


def _module_at(model: Any, path: str) -> Any:
    """The module at a dotted path (list items by index)."""
    found = model
    for name in path.split("."):
        found = found[int(name)] if isinstance(found, list) else found[name]
    return found


def _install(targets: Sequence[tuple[Any, str, RowLoRALinear]]) -> None:
    """Put each wrapper at its path in its model."""
    from mlx.utils import tree_unflatten

    by_model: dict[int, tuple[Any, list[tuple[str, RowLoRALinear]]]] = {}
    for model, path, wrapper in targets:
        by_model.setdefault(id(model), (model, []))[1].append((path, wrapper))
    for model, fresh in by_model.values():
        model.update_modules(tree_unflatten(fresh))


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
    """Give ``model`` a set of per-row adapters; the lane's batch forwards run the slots of
    their rows (``uid_slots``, ``routed``)."""
    adapters = RowAdapters(model, max_bytes)
    model._mlx_providers_adapters = adapters
    return adapters


def routed(model: Any, uids: Sequence[int]) -> AbstractContextManager[Any]:
    """The context a batch forward over ``uids`` runs in: their rows' adapters (the lane's
    batches run their forwards in it, ``upstream.batches``); none while no row has one."""
    adapters = adapters_of(model)
    if adapters is None or not adapters.uid_slots:
        return nullcontext()
    return adapters.rows([adapters.uid_slots.get(uid, 0) for uid in uids])
