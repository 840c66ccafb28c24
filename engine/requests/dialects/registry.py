"""Which dialect a tokenizer speaks: the first family whose marks it carries, else the
default (tagged JSON in mlx-lm's markers).

The families are collected, not listed: every module of this package is imported, and each
``Dialect`` subclass a module defines with a ``priority`` above 0 is a family. They are
checked highest priority first (a family whose marks another's include goes above it). A
new family is one module here; two families may not share a priority or a name. No mlx.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from engine.requests.dialects.dialect import Dialect, TokenizerFacts

_PACKAGE = __name__.rpartition(".")[0]


def _package_modules() -> list[ModuleType]:
    """Every module of this package but this one, imported."""
    package = importlib.import_module(_PACKAGE)
    return [importlib.import_module(f"{_PACKAGE}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)
            if f"{_PACKAGE}.{info.name}" != __name__]


def collect_families(modules: list[ModuleType]) -> tuple[type[Dialect], ...]:
    """The family dialects the modules define, highest priority first; raises ValueError
    when two share a priority (the order would be arbitrary) or a name."""
    found = [value for module in modules for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, Dialect)
             and value.__module__ == module.__name__ and value.priority > 0]
    families = tuple(sorted(found, key=lambda family: -family.priority))
    for key in ("priority", "name"):
        seen: dict[object, str] = {}
        for family in (*families, Dialect):
            value = getattr(family, key)
            if value in seen:
                raise ValueError(f"dialects {seen[value]} and {family.__qualname__} share "
                                 f"the {key} {value!r}")
            seen[value] = family.__qualname__
    return families


# Family dialects, highest priority first.
FAMILIES: tuple[type[Dialect], ...] = collect_families(_package_modules())


def dialect_for(facts: TokenizerFacts) -> Dialect:
    """The dialect of the tokenizer these facts describe."""
    for family in FAMILIES:
        if family.matches(facts):
            return family(facts)
    return Dialect(facts)


def reasoning_tokens() -> tuple[tuple[str, str], ...]:
    """Every token pair a dialect declares as marking reasoning, each once: a vocabulary
    that holds both of a pair belongs to a model that reasons."""
    pairs: dict[tuple[str, str], None] = {}
    dialects: tuple[type[Dialect], ...] = (Dialect, *FAMILIES)
    for dialect in dialects:
        pairs.update(dict.fromkeys(dialect.reasoning_tokens))
    return tuple(pairs)
