"""Functions of mlx and of mlx-lm's family modules, wrapped once per process, taking their
replacement only inside a forward of a model marked for it.

The CPU kernels (``kernel_layers``) reach RMSNorm and RoPE through ``mx.fast`` and
attention through each family module's ``scaled_dot_product_attention``: every family
calls those names, so the names are what gets wrapped. A wrapper takes its kernel only
while ``in_marked_forward()`` (a thread-local flag that a marked model's ``__call__`` sets),
so other models in the process, and other threads, keep MLX's own functions.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

# A wrapper builder: the original function in, the function that replaces it out.
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

_forward = threading.local()  # .active: inside a forward of a marked model
_lock = threading.Lock()
_marked: dict[type, type] = {}  # model class -> its marked subclass


def in_marked_forward() -> bool:
    """Whether this thread is inside a forward of a marked model."""
    return bool(getattr(_forward, "active", False))


@contextmanager
def marked_forward(model: Any) -> Iterator[None]:
    """Inside: a forward that calls a marked model's parts directly (its backbone, not its
    ``__call__``) takes the kernels as its ``__call__`` would."""
    outer = in_marked_forward()
    _forward.active = outer or type(model) in _marked.values()
    try:
        yield
    finally:
        _forward.active = outer


def _marked_class(cls: type) -> type:
    """A subclass of a model class whose forward sets the thread's flag."""
    found = _marked.get(cls)
    if found is not None:
        return found

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = in_marked_forward()
        _forward.active = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _forward.active = outer

    marked = subclass_calling(cls, __call__)
    _marked[cls] = marked
    return marked


def subclass_calling(cls: type, call: Callable[..., Any]) -> type:
    """A subclass of ``cls`` under its names (mlx-lm's type checks and reprs still read
    ``cls``) whose instances' ``__call__`` is ``call``."""
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _wrap_once(owner: Any, wrappers: dict[str, Wrapper]) -> None:
    """Replace each of ``owner``'s functions named in ``wrappers`` by its wrapper, once per
    process (a wrapper carries ``_mlx_providers_kernel``); call under ``_lock``."""
    for name, wrap in wrappers.items():
        current = getattr(owner, name, None)
        if current is not None and not getattr(current, "_mlx_providers_kernel", False):
            wrapped = wrap(current)
            wrapped.__wrapped__ = current  # type: ignore[attr-defined]
            wrapped._mlx_providers_kernel = True  # type: ignore[attr-defined]
            setattr(owner, name, wrapped)


def _mark(model: Any) -> None:
    """This model instance's forwards set the flag (its class becomes the marked one)."""
    if type(model) not in _marked.values():
        model.__class__ = _marked_class(type(model))


def wrap_fast(model: Any, wrappers: dict[str, Wrapper]) -> None:
    """Wrap ``mx.fast``'s functions named in ``wrappers`` (once) and mark ``model``."""
    with _lock:
        _wrap_once(mx.fast, wrappers)
        _mark(model)


def wrap_family(model: Any, wrappers: dict[str, Wrapper]) -> bool:
    """Wrap the model's family module's functions named in ``wrappers`` (once) and mark
    ``model``; False when the family computes attention its own way (MLX's then)."""
    family = sys.modules.get(type(model).__module__)
    if family is None or getattr(family, "scaled_dot_product_attention", None) is None:
        return False
    with _lock:
        _wrap_once(family, wrappers)
        _mark(model)
    return True
