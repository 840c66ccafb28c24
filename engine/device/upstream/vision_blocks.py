"""The vision library's tower, one block at a time: each block's output recorded while the
tower's graph is built, so the graph can be evaluated a block per engine step.

mlx-vlm's towers have no hook for this: the tower's own block instances get a subclass whose
``__call__`` records (``install_recorder``, at load); it records only inside ``recording``
on the same thread, so other towers of the class, and other threads, run as mlx-vlm ships.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

_sink = threading.local()  # .outputs: where this thread's tower blocks record, if anywhere
_recorded: dict[type, type] = {}  # block class -> its recording subclass


def _recording_class(cls: type) -> type:
    found = _recorded.get(cls)
    if found is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            outputs = getattr(_sink, "outputs", None)
            if outputs is not None:
                outputs.append(out[0] if isinstance(out, tuple | list) else out)
            return out

        found = _recorded[cls] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return found


def install_recorder(tower: Any) -> bool:
    """Make this tower's blocks (its own instances, not their class) record their outputs
    inside ``recording``; False when no repeated block was found (the tower then runs whole)."""
    cls = block_class(tower)
    if cls is None:
        return False
    recording_class = _recording_class(cls)
    for _, module in tower.named_modules():
        if type(module) is cls:
            module.__class__ = recording_class
    return True


@contextmanager
def recording(outputs: list[mx.array]) -> Iterator[None]:
    """While building a tower's graph on this thread, collect each block's output (its first
    array) into ``outputs``."""
    _sink.outputs = outputs
    try:
        yield
    finally:
        _sink.outputs = None


def block_class(tower: Any) -> type | None:
    """The class of the tower's repeated blocks: the most common class among modules named
    ``...<name>.<index>`` (``encoder.layers.3``, ``blocks.7``, ``transformer.layers.0``)."""
    counts: dict[type, int] = {}
    for name, module in tower.named_modules():
        # Blocks hold modules of their own (a numbered Linear in a projector does not).
        if name.rsplit(".", 1)[-1].isdigit() and _has_submodules(module):
            counts[type(module)] = counts.get(type(module), 0) + 1
    return max(counts, key=lambda c: counts[c]) if counts else None


def _has_submodules(module: Any) -> bool:
    import mlx.nn as nn

    return any(isinstance(value, nn.Module) or (
        isinstance(value, list | tuple) and any(isinstance(v, nn.Module) for v in value))
        for value in module.children().values())
