"""Which mlx-lm architecture a model directory names, checked before mlx-lm builds it.

``mlx_lm.load`` fails late and by accident on a directory it cannot build: a missing
config.json is a bare ``FileNotFoundError`` without the model's name, a corrupt one a
``JSONDecodeError`` with a line number, an unknown ``model_type`` "Model type X not
supported.", and one architecture module (olmo) calls ``sys.exit`` when imported without
its extra package. Here each becomes an error of the ``OSError`` or ``ValueError`` family
that names the model and the cause, raised before any weight is read.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.errors import InvalidModelError, UnsupportedModelError

__all__ = ["architecture_module", "read_model_config"]


def read_model_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict that names a ``model_type``.

    Raises ``FileNotFoundError`` when the directory or its config.json is missing, the
    ``OSError`` of an unreadable file as it is, and ``InvalidModelError`` (a ValueError)
    when the file is not a JSON object naming a model type.
    """
    config_file = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidModelError(f"{config_file} is corrupt: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidModelError(f"{config_file} is corrupt: a JSON {type(config).__name__}, "
                                "not an object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidModelError(f"{config_file} names no model_type, so no architecture can "
                                "be chosen for it")
    return config


def _module_name(config: dict[str, Any]) -> str:
    """The mlx-lm module mlx-lm itself picks for a config (its two remapping tables)."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = str(config["model_type"])
    architectures = config.get("architectures") or ()
    for architecture in (architectures,) if isinstance(architectures, str) else architectures:
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, architecture))
        if remapped is not None:
            return str(remapped)
    return str(MODEL_REMAPPING.get(model_type, model_type))


def architecture_module(config: dict[str, Any], path: Path) -> ModuleType:
    """The mlx-lm module that builds this model; ``UnsupportedModelError`` naming the
    model type when this mlx-lm has none, or when the module needs a missing package."""
    from mlx_lm import __version__ as mlx_lm_version

    name = _module_name(config)
    qualified = f"mlx_lm.models.{name}"
    where = f"{path} (model_type {config['model_type']!r})"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name == qualified:
            raise UnsupportedModelError(
                f"{where}: mlx-lm {mlx_lm_version} has no architecture {name!r}; a newer "
                "mlx-lm may support it") from exc
        raise UnsupportedModelError(
            f"{where}: mlx-lm's {name} architecture needs the package {exc.name!r}, "
            "which is not installed") from exc
    except SystemExit as exc:  # mlx_lm.models.olmo exits when ai2-olmo is missing
        raise UnsupportedModelError(
            f"{where}: mlx-lm's {name} architecture refused to import (it exited with "
            f"status {exc.code}); it needs an extra package, see its message above") from exc
