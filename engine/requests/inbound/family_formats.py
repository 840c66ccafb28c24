"""The vision families whose formats are written in modules of their own, by ``model_type``.

``vision_formats.FORMATS`` reaches these builders through this table, imported when a
checkpoint of one of them is read (each module builds on ``vision_formats``' base, so it
cannot be imported from there at load time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.requests.inbound.gemma4_format import build_gemma4
from engine.requests.inbound.idefics3_format import build_idefics3
from engine.requests.inbound.internvl_format import build_internvl
from engine.requests.inbound.llama4_format import build_llama4
from engine.requests.inbound.llava_format import build_llava
from engine.requests.inbound.vision_formats import VisionFormat

BUILDERS: dict[str, Callable[[Mapping[str, Any], Any, Mapping[str, Any]], VisionFormat]] = {
    "llava": build_llava, "smolvlm": build_idefics3, "idefics3": build_idefics3,
    "internvl_chat": build_internvl, "gemma4": build_gemma4,
    "llama4": build_llama4,
}
