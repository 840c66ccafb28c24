"""When an idle engine lets its chat model go (``EngineConfig.keep_alive``): pure timing.

The engine thread tells ``KeepAlive`` when the model was last in use (loaded, or a turn
that ran rows) and what each request asked for; it answers when the model may be unloaded.
The idle loop sleeps on its command queue until then, as it does for a row's deadline:
the unload time is one more deadline, never a polling loop. No mlx here.

As Ollama's ``keep_alive``: the latest request's value applies (a request that sets none
brings back the configured one), and the clock starts when the last row ends.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Final


class _Configured(Enum):
    CONFIGURED = "configured"


# ``Engine.submit(keep_alive=CONFIGURED)``, the default: the engine's configured keep_alive.
CONFIGURED: Final = _Configured.CONFIGURED
KeepAliveArg = float | None | _Configured


def check_keep_alive(value: object) -> float | None:
    """A request's ``keep_alive`` as seconds (None: keep the model loaded); raises
    ``TypeError``/``ValueError`` naming what is wrong, on the caller's thread."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"keep_alive must be seconds (a number >= 0) or None, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"keep_alive must be a finite number of seconds >= 0 (None keeps "
                         f"the model loaded), got {value!r}")
    return float(value)


class KeepAlive:
    """The chat model's idle deadline (engine thread only)."""

    def __init__(self, seconds: float | None) -> None:
        self.configured = seconds
        self.seconds = seconds  # what the latest request asked for, else the configured value
        self._used_at: float | None = None

    def ask(self, seconds: float | None) -> None:
        """A request arrived asking the model to stay ``seconds`` after it (None: forever)."""
        self.seconds = seconds

    def used(self, now: float) -> None:
        """The model was loaded, or a turn ran rows, at ``now`` (monotonic seconds)."""
        self._used_at = now

    def unload_at(self) -> float | None:
        """When an engine idle since its last use may unload (None: never)."""
        if self.seconds is None or self._used_at is None:
            return None
        return self._used_at + self.seconds

    def due(self, now: float) -> bool:
        """Whether an idle engine should unload now."""
        at = self.unload_at()
        return at is not None and now >= at


__all__ = ["CONFIGURED", "KeepAlive", "KeepAliveArg", "check_keep_alive"]
