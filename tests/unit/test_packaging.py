"""Every package in the source tree ships in the wheel.

A hand-written package list once left engine.device, engine.models and engine._platform out
of non-editable installs while editable ones (and so the suite) worked.
"""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_includes_every_package_in_the_tree() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(find_packages(str(ROOT), include=config["packages"]["find"]["include"]))
    in_tree = {str(init.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("engine", "mlx_providers") for init in (ROOT / top).rglob("__init__.py")}
    assert in_tree <= shipped, f"not shipped: {sorted(in_tree - shipped)}"
    assert not any(name.startswith(("tests", "bench", "examples")) for name in shipped)


def test_the_license_is_an_spdx_expression() -> None:
    """PEP 639: a plain SPDX string (the old ``{text = ...}`` table makes setuptools warn)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
