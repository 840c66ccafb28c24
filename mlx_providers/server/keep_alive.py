"""``keep_alive`` as Ollama's API spells it, for ``--keep-alive`` and request bodies.

A number is seconds; a string is a Go duration ("30s", "5m", "1h30m", "500ms"), or a bare
number of seconds; a negative value keeps the model loaded forever; 0 unloads it as soon
as the engine is idle. On chat completions and Responses it is this server's extension
field: the engine keeps its model loaded that long after the request (the latest request's
value applies, as in Ollama), and a request without one brings back ``--keep-alive``.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0,
          "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")


def duration_seconds(value: object) -> float:
    """Seconds for a keep_alive value; negative means forever. Raises ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"keep_alive must be seconds or a duration string such as '5m', "
                         f"got {type(value).__name__}")
    if isinstance(value, str):
        value = _parsed(value.strip())
    if not math.isfinite(value):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return float(value)


def _parsed(text: str) -> float:
    if _NUMBER.fullmatch(text):
        return float(text)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    seconds, at = 0.0, 0
    for part in _PART.finditer(body):
        if part.start() != at:
            break
        seconds += float(part.group(1)) * _UNITS[part.group(2)]
        at = part.end()
    if not body or at != len(body):
        raise ValueError(f"keep_alive {text!r} is not a duration: seconds, or a number and "
                         "a unit (ns, us, ms, s, m, h) such as '30s', '5m', '1h30m'")
    return sign * seconds


def _checked(value: Any) -> float | None:
    return None if value is None else duration_seconds(value)


# A request body's ``keep_alive``: seconds (negative: forever), None when not sent.
KeepAliveField = Annotated[float | None, BeforeValidator(_checked)]


def keep_alive_option(text: str) -> float | None:
    """``--keep-alive``: seconds, a duration, or a negative value (None: forever)."""
    try:
        seconds = duration_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return None if seconds < 0 else seconds
