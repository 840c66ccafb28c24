"""The dependency direction of DESIGN.md, enforced by parsing imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = {"scheduler", "request", "streams", "footprint", "text", "errors", "stats", "config",
        "registry", "blas"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).glob("*.py"))


@pytest.mark.parametrize("path", modules("engine"), ids=lambda p: p.name)
def test_engine_knows_nothing_of_the_frameworks(path: Path) -> None:
    bad = {n for n in imports_of(path) if n.split(".")[0] in {"langchain_core", "langchain",
                                                             "llama_index", "mlx_providers"}}
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", [p for p in modules("engine") if p.stem in PURE],
                         ids=lambda p: p.name)
def test_pure_engine_modules_import_no_mlx(path: Path) -> None:
    bad = {n for n in imports_of(path) if n.split(".")[0] in {"mlx", "mlx_lm"}}
    assert not bad, f"{path.name} must stay testable without mlx but imports {bad}"


@pytest.mark.parametrize("path", modules("mlx_providers"), ids=lambda p: p.name)
def test_adapters_use_only_the_engine_public_api(path: Path) -> None:
    names = imports_of(path)
    private = {n for n in names if n.startswith("engine.")}
    direct = {n for n in names if n.split(".")[0] in {"mlx", "mlx_lm"}}
    assert not private and not direct, f"{path.name} imports {private | direct}"


def test_engine_init_loads_blas_before_anything_imports_mlx() -> None:
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    first_import = next(n for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import))
    assert isinstance(first_import, ast.ImportFrom) and first_import.module == "engine._platform.blas"
