"""mlx-providers' continuous-batching engine: the public API.

On Linux a fast BLAS is loaded before mlx is first imported (see ``engine._platform.blas``),
so import this package before ``mlx`` for full CPU speed.
"""

from engine._platform.blas import activate_fast_blas, blas_info

activate_fast_blas()

from engine.config import EngineConfig
from engine.core.stats import EngineStats, SpeedUp
from engine.core.step_probe import StepProbe, TurnReport
from engine.core.streams import RequestHandle
from engine.declared import DeclaredModel, declared_model
from engine.embedding.request import EmbeddingHandle, Embeddings, check_texts
from engine.engine import Engine
from engine.errors import (
    ContextLengthError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    InvalidConstraintError,
    InvalidModelError,
    InvalidRequestError,
    KVBudgetError,
    ModelDownloadError,
    ModelFormatError,
    ModelLoadError,
    ModelUnavailableError,
    OutputTruncatedError,
    RequestCancelledError,
    RequestError,
    RequestTimeoutError,
    UnsupportedCombinationError,
    UnsupportedMediaError,
    UnsupportedModelError,
)
from engine.models import resolve_model
from engine.models.embedding_model import DEFAULT_EMBEDDING_NAME, embedding_model_name
from engine.registry import get_embedding_engine, get_engine
from engine.requests.inbound.chat import (
    REQUEST_OPTIONS,
    SAMPLING_FIELDS,
    ChatRequest,
    sampling_from_openai,
    sampling_from_options,
)
from engine.requests.inbound.images import IMAGE_PARTS
from engine.requests.inbound.messages import Message, MessageToolCall, messages_from_openai
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
)
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.inbound.text_request import Request, TextRequest
from engine.requests.inbound.tool_specs import ToolSpec, normalize_tool_choice, normalize_tools
from engine.requests.inbound.videos import MEDIA_PARTS, VIDEO_PARTS
from engine.requests.outbound.logprobs import TokenText, openai_logprobs, token_texts
from engine.requests.outbound.results import (
    Completion,
    FinishReason,
    StreamEvent,
    TokenLogprob,
    Usage,
)
from engine.requests.outbound.tool_calls import InvalidToolCall, ToolCall, ToolCallDelta
from engine.requests.prepare import ImageSupport
from engine.runtime.follower import distributed_rank, follow

__all__ = [
    "DEFAULT_EMBEDDING_NAME",
    "IMAGE_PARTS",
    "MEDIA_PARTS",
    "REQUEST_OPTIONS",
    "SAMPLING_FIELDS",
    "VIDEO_PARTS",
    "ChatRequest",
    "Completion",
    "Constraint",
    "ContextLengthError",
    "DeclaredModel",
    "EmbeddingHandle",
    "Embeddings",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "ImageSupport",
    "InvalidConstraintError",
    "InvalidModelError",
    "InvalidRequestError",
    "InvalidToolCall",
    "JsonObject",
    "JsonSchema",
    "KVBudgetError",
    "LarkGrammar",
    "Message",
    "MessageToolCall",
    "ModelDownloadError",
    "ModelFormatError",
    "ModelLoadError",
    "ModelUnavailableError",
    "OutputTruncatedError",
    "Regex",
    "Request",
    "RequestCancelledError",
    "RequestError",
    "RequestHandle",
    "RequestTimeoutError",
    "SamplingParams",
    "SpeedUp",
    "StepProbe",
    "StreamEvent",
    "TextRequest",
    "TokenLogprob",
    "TokenText",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "TurnReport",
    "UnsupportedCombinationError",
    "UnsupportedMediaError",
    "UnsupportedModelError",
    "Usage",
    "activate_fast_blas",
    "blas_info",
    "check_texts",
    "declared_model",
    "distributed_rank",
    "embedding_model_name",
    "follow",
    "get_embedding_engine",
    "get_engine",
    "messages_from_openai",
    "normalize_tool_choice",
    "normalize_tools",
    "openai_logprobs",
    "resolve_model",
    "sampling_from_openai",
    "sampling_from_options",
    "token_texts",
]
