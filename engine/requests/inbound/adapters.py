"""A request's LoRA adapter directory, checked where the request is made. No mlx.

An adapter is mlx-lm's format: ``adapter_config.json`` (``fine_tune_type`` "lora",
``lora_parameters`` with an integer ``rank`` and a number ``scale``) beside
``adapters.safetensors``. What can be told from the files alone is refused at ``submit``,
naming the field ``adapter``; whether its layers and shapes fit the base model is checked
when the engine loads it (``engine.device.adapters.row_adapters``), where a misfit fails that
request alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError


def adapter_config(path: str) -> dict[str, Any]:
    """The adapter's config, once its files are there and it is a LoRA one."""
    where = Path(path).expanduser()
    config_file = where / "adapter_config.json"
    for needed in (config_file, where / "adapters.safetensors"):
        if not needed.is_file():
            raise InvalidRequestError(
                f"adapter {path}: no {needed.name} (mlx-lm's LoRA format: "
                "adapter_config.json and adapters.safetensors)", "adapter")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise InvalidRequestError(f"adapter {path}: adapter_config.json is not JSON ({exc})",
                                  "adapter") from exc
    if not isinstance(config, dict):
        raise InvalidRequestError(f"adapter {path}: adapter_config.json is not an object",
                                  "adapter")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidRequestError(f"adapter {path}: fine_tune_type {kind!r} is not served "
                                  "per row (only 'lora'); fuse it into a copy of the model",
                                  "adapter")
    lora = config.get("lora_parameters")
    if not isinstance(lora, dict) or "scale" not in lora or "rank" not in lora:
        raise InvalidRequestError(f"adapter {path}: lora_parameters needs 'rank' and "
                                  "'scale'", "adapter")
    rank, scale = lora["rank"], lora["scale"]
    # bool is an int to Python, not to mlx-lm's LoRA layers.
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequestError(f"adapter {path}: lora_parameters' rank {rank!r} is not a "
                                  "positive integer", "adapter")
    if (not isinstance(scale, int | float) or isinstance(scale, bool)
            or not math.isfinite(scale)):
        raise InvalidRequestError(f"adapter {path}: lora_parameters' scale {scale!r} is not a "
                                  "finite number", "adapter")
    return config
