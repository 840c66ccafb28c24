"""A face's ``keep_alive`` as ``Engine.submit`` takes it, shared by every door.

The faces speak Ollama's (and ``ChatOllama``'s) convention: seconds the model stays loaded
once the engine is idle after a request, 0 to unload it right after, a negative value to
keep it loaded, None when the caller set nothing (the engine's ``EngineConfig.keep_alive``
applies). The engine's own spelling of "keep it loaded" is None.
"""

from __future__ import annotations

from typing import Any


def submit_options(keep_alive: float | None) -> dict[str, Any]:
    """``Engine.submit``'s keyword for a face's keep_alive (none set: the engine's own)."""
    if keep_alive is None:
        return {}
    return {"keep_alive": None if keep_alive < 0 else keep_alive}
