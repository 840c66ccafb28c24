"""A model that could not load, as the error its caller catches by kind.

Getting the files failed (``OSError``: a missing path, the hub, an unreadable file) or
the files cannot be run (anything else: an unknown architecture, a corrupt config, weights
that do not fit). Either way the message names the model and the cause.
"""

from __future__ import annotations

import os

from engine.config import ModelSpec
from engine.errors import ModelFormatError, ModelLoadError, ModelUnavailableError


def load_error(exc: Exception, spec: ModelSpec) -> ModelLoadError:
    """``exc`` (raised while resolving or loading ``spec``) as a ``ModelLoadError`` of its
    family, with ``exc`` as its cause."""
    if isinstance(exc, ModelLoadError):  # already says what failed (an unsupported upstream)
        return exc
    name = "the default model" if spec is None else repr(os.fspath(spec))
    kind = ModelUnavailableError if isinstance(exc, OSError) else ModelFormatError
    error = kind(f"the model could not be loaded: {name}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
