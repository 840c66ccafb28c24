"""Every name of mlx, mlx-lm and mlx-vlm that the seam's overrides rely on, checked at load.

The seam (this package) reaches past those libraries' public API: it subclasses mlx-lm's
batches, sets their private fields, wraps ``mx.fast``'s functions, records the vision
library's tower blocks. A release that renames one would otherwise surface as an
``AttributeError`` on some row, mid-run. ``check_upstream`` resolves the whole list once
per process, before the first model loads, and raises one ``UnsupportedUpstreamError``
naming every missing name, the installed versions and what each one served.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from engine.errors import UnsupportedUpstreamError

# The versions the pins allow, said in the error so the fix is plain: read from this
# package's own metadata (pyproject.toml's pins); these where it is not installed.
SUPPORTED = {"mlx": ">=0.32", "mlx-lm": ">=0.32,<0.33", "mlx-vlm": ">=0.7.10,<0.8"}


@dataclass(frozen=True)
class Reach:
    """One upstream name and the site that relies on it.

    ``path``: the module, then attributes (``mlx_lm.generate.GenerationBatch._step``);
    ``instance``: an attribute instances get in ``__init__``, looked up on a sample
    instance (``_SAMPLES``) rather than on the class.
    """

    package: str
    path: str
    site: str
    instance: bool = False


def _fields(package: str, owner: str, names: Iterable[str], site: str) -> list[Reach]:
    return [Reach(package, f"{owner}.{name}", site, instance=True) for name in names]


_GEN = "mlx_lm.generate.GenerationBatch"
_PROMPT = "mlx_lm.generate.PromptProcessingBatch"
_RING = "mlx_lm.models.cache.RotatingKVCache"
_QUANT = "mlx_lm.models.cache.QuantizedKVCache"

REQUIRED: tuple[Reach, ...] = (
    # The decoding batch's step, re-done with the batch's grammar masks and row adapters.
    Reach("mlx-lm", f"{_GEN}._step", "the lane's decoding step (grammar masks, adapters)"),
    Reach("mlx-lm", f"{_GEN}.extend", "rows joining the decoding batch"),
    *_fields("mlx-lm", _GEN, ("_next_tokens", "_next_logprobs", "_current_tokens",
                              "_current_logprobs", "_token_context", "_num_tokens",
                              "_matchers", "logits_processors", "samplers",
                              "fallback_sampler", "tokens", "prompt_cache", "model", "uids",
                              "stop_sequences", "max_tokens"),
             "the lane's decoding step and rows rejoining it (fast-forward, speculation)"),
    # The prefill batch: its forwards run each row's adapter.
    Reach("mlx-lm", f"{_PROMPT}.prompt", "prefill with row adapters"),
    Reach("mlx-lm", f"{_PROMPT}.generate", "a group's first step with row adapters"),
    Reach("mlx-lm", f"{_PROMPT}._copy", "a split prefill batch keeping the lane's class"),
    *_fields("mlx-lm", _PROMPT, ("uids", "model"), "prefill with row adapters"),
    Reach("mlx-lm", "mlx_lm.generate.BatchGenerator.insert_segments", "the batch lane"),
    Reach("mlx-lm", "mlx_lm.generate.BatchGenerator.extract_cache", "prefix reuse"),
    Reach("mlx-lm", "mlx_lm.generate.StopSequences", "rows rejoining the decoding batch"),
    Reach("mlx-lm", "mlx_lm.models.cache.TokenBuffer", "rows rejoining the decoding batch"),
    # A sliding window's ring, cut and copied per row.
    Reach("mlx-lm", f"{_RING}._temporal_order", "a row's own sliding-window cache"),
    Reach("mlx-lm", f"{_RING}._idx", "a row's own sliding-window cache", instance=True),
    # A quantized KV cache the generator batches (quantized_kv): a row is mlx-lm's own
    # single-request cache, batched through the merge the generator calls on a row's layer;
    # the batch's ``bits`` sends mlx-lm's attention down its quantized matmuls.
    Reach("mlx-lm", f"{_QUANT}.keys_and_values", "a row's quantized KV cache"),
    Reach("mlx-lm", f"{_QUANT}.trim", "a row's quantized KV cache"),
    Reach("mlx-lm", f"{_QUANT}.make_mask", "a row's quantized KV cache"),
    Reach("mlx-lm", f"{_QUANT}.state", "a row's quantized KV cache"),
    *_fields("mlx-lm", _QUANT, ("keys", "values", "offset", "bits", "group_size"),
             "a row's quantized KV cache"),
    Reach("mlx-lm", "mlx_lm.models.cache.KVCache", "a float row quantized to join the batch"),
    Reach("mlx-lm", "mlx_lm.models.cache.make_prompt_cache", "a row's quantized KV cache"),
    Reach("mlx-lm", "mlx_lm.models.cache.dynamic_roll",
          "the quantized batch's right padding rolled left"),
    Reach("mlx-lm", "mlx_lm.models.base.create_causal_mask", "the quantized batch's mask"),
    Reach("mlx-lm", "mlx_lm.models.base.scaled_dot_product_attention",
          "attention on the quantized batch (its bits pick the quantized path)"),
    Reach("mlx-lm", "mlx_lm.models.base.quantized_scaled_dot_product_attention",
          "attention on the quantized batch"),
    Reach("mlx-lm", "mlx_lm.generate._merge_caches",
          "rows' quantized caches batched through their layer's merge"),
    # The CPU kernels take RMSNorm and RoPE wherever a family calls them.
    Reach("mlx", "mlx.core.fast.rms_norm", "the CPU kernels' RMSNorm"),
    Reach("mlx", "mlx.core.fast.rope", "the CPU kernels' RoPE"),
    *(Reach("mlx-lm", f"mlx_lm.models.{family}.{name}", "the CPU kernels' decode layer")
      for family in ("llama", "qwen2", "qwen3")
      for name in ("TransformerBlock", "scaled_dot_product_attention")),
    Reach("mlx-lm", "mlx_lm.models.rope_utils.Llama3RoPE", "the CPU kernels' decode layer"),
)

# The vision extra's names, checked when a vision-language model loads (``check_vision``).
VISION_REQUIRED: tuple[Reach, ...] = (
    Reach("mlx-vlm", "mlx_vlm.utils.load_model", "a vision-language model's tower"),
    Reach("mlx-vlm", "mlx_vlm.models.cache.ArraysCache",
          "a hybrid M-RoPE family's recurrent layers, prefilled by its language model"),
)

# What the generator sets in ``__init__``: checked on the lane's own generator (``require``).
GENERATOR_FIELDS = ("_generation_batch", "_prompt_batch", "_uid_count")


def _samples() -> dict[str, Callable[[], Any]]:
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    return {_GEN: lambda: GenerationBatch.empty(None, None),
            _PROMPT: lambda: PromptProcessingBatch.empty(None, None),
            _RING: lambda: RotatingKVCache(max_size=4),
            _QUANT: lambda: QuantizedKVCache()}


def _resolve(reach: Reach, samples: dict[str, Callable[[], Any]]) -> bool:
    parts = reach.path.split(".")
    module_path, rest = "", ""
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_path, rest = ".".join(parts[:split]), ".".join(parts[split:])
        try:
            found: Any = importlib.import_module(module_path)
            break
        except ImportError:
            continue
    else:
        return False
    names = rest.split(".")
    if reach.instance:
        owner = f"{module_path}.{'.'.join(names[:-1])}"
        make = samples.get(owner)
        if make is None:
            return False
        try:
            return hasattr(make(), names[-1])
        except Exception:  # the sample itself no longer builds: the name is not there
            return False
    for name in names:
        if not hasattr(found, name):
            return False
        found = getattr(found, name)
    return True


def missing(required: Iterable[Reach] = REQUIRED) -> list[Reach]:
    """The names of ``required`` this install lacks."""
    try:
        samples = _samples()
    except Exception:  # the sample classes themselves are gone: every instance reach fails
        samples = {}
    return [reach for reach in required if not _resolve(reach, samples)]


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def supported(package: str) -> str:
    """The version range this package's pins allow for ``package``."""
    try:
        pins = importlib.metadata.requires("mlx-providers") or []
    except importlib.metadata.PackageNotFoundError:
        pins = []
    for pin in pins:
        found = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*([^;]*)", pin)
        if found and found.group(1).lower() == package and found.group(3).strip():
            return found.group(3).strip()
    return SUPPORTED.get(package, "")


def unsupported(reaches: Iterable[Reach]) -> UnsupportedUpstreamError:
    """One error naming every missing reach, the installed versions and the supported."""
    reaches = list(reaches)
    packages = sorted({reach.package for reach in reaches})
    installed = ", ".join(f"{p} {version(p)}" for p in packages)
    wanted = ", ".join(f"{p}{supported(p)}" for p in packages)
    lines = "; ".join(f"{reach.path} ({reach.site})" for reach in reaches)
    return UnsupportedUpstreamError(
        f"this install ({installed}) lacks what mlx-providers relies on: {lines}. "
        f"Install a supported version: {wanted}.", [reach.path for reach in reaches])


@cache
def _checked() -> tuple[Reach, ...]:
    return tuple(missing())


def check_upstream() -> None:
    """Raise ``UnsupportedUpstreamError`` naming every name this install lacks (resolved
    once per process)."""
    gone = _checked()
    if gone:
        raise unsupported(gone)


@cache
def _vision_checked() -> tuple[Reach, ...]:
    return tuple(missing(VISION_REQUIRED))


def check_vision() -> None:
    """``check_upstream`` for the vision extra's names (a vision-language model loading)."""
    gone = _vision_checked()
    if gone:
        raise unsupported(gone)


def require(obj: Any, owner: str, names: Iterable[str], site: str) -> None:
    """Raise ``UnsupportedUpstreamError`` unless ``obj`` (an instance of ``owner``) has
    every one of ``names``."""
    gone = [Reach(owner.split(".")[0].replace("_", "-"), f"{owner}.{name}", site, True)
            for name in names if not hasattr(obj, name)]
    if gone:
        raise unsupported(gone)
