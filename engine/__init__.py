"""mlx-providers' continuous-batching engine: the public API.

On Linux a fast BLAS is loaded before mlx is first imported (see ``engine.blas``),
so import this package before ``mlx`` for full CPU speed.
"""

try:  # TEMP until blas.py lands
    from engine.blas import activate_fast_blas, blas_info

    activate_fast_blas()
except ImportError:
    pass

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import (  # noqa: E402
    ContextLengthError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    KVBudgetError,
    RequestTimeoutError,
)
from engine.registry import get_engine  # noqa: E402
from engine.request import (  # noqa: E402
    Completion,
    FinishReason,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    Usage,
)
from engine.stats import EngineStats  # noqa: E402
from engine.streams import RequestHandle  # noqa: E402

__all__ = [
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "KVBudgetError",
    "RequestHandle",
    "RequestTimeoutError",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "Usage",
    "activate_fast_blas",
    "blas_info",
    "get_engine",
]
