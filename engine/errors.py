"""Every error the engine raises; each names what went wrong and what to do.

Two families: ``RequestError`` belongs to one request (its consumer alone sees it and
every other row goes on), ``EngineError`` to the engine itself or to a request the engine
could not complete. Errors about bad input also subclass ``ValueError``/``TypeError`` so
that callers may catch them the usual way.
"""

from __future__ import annotations


class RequestError(Exception):
    """A failure of one request only; the engine and every other row go on."""


class EngineError(RuntimeError):
    """The engine could not complete a request (the cause is in ``__cause__``)."""


class EngineDeadError(EngineError):
    """The engine thread died; every waiter and every later submit gets this."""


class ModelLoadError(EngineDeadError):
    """The model could not be loaded; the message names the model and the cause, which is
    also ``__cause__``. The engine that tried is dead (a new one may retry, once the cause is
    fixed: ``get_engine`` makes a new one). Caught as one of two families by what failed:
    ``ModelUnavailableError`` (an ``OSError``) or ``ModelFormatError`` (a ``ValueError``)."""


class ModelUnavailableError(ModelLoadError, OSError):
    """Getting the model's files failed: a missing path, an unreachable hub id, an
    unreadable or incomplete file."""


class ModelFormatError(ModelLoadError, ValueError):
    """The model's files are there but cannot be run: an architecture mlx-lm does not ship,
    a corrupt or inconsistent config, weights that do not fit the architecture."""


class UnsupportedUpstreamError(ModelLoadError, ImportError):
    """This install's mlx, mlx-lm or mlx-vlm lacks names the engine relies on (a release
    outside the pins): raised at load, naming each missing name, the installed versions
    and the supported ones (``names``: the missing names)."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


class EngineClosedError(EngineError):
    """The engine was closed before or while the request ran."""


class ContextLengthError(RequestError, ValueError):
    """The prompt plus ``max_tokens`` does not fit in the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_tokens + max_tokens} exceeds the model's context limit of {limit} tokens; "
            "shorten the prompt or lower max_tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


class KVBudgetError(RequestError, ValueError):
    """A request's worst-case KV cache would not fit in the budget even alone."""

    def __init__(self, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"request needs up to {needed_bytes} KV-cache bytes (prompt + max_tokens) but "
            f"EngineConfig.kv_budget_bytes is {budget_bytes}; lower max_tokens, shorten the "
            "prompt or raise the budget"
        )
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class InvalidRequestError(RequestError, ValueError, TypeError):
    """A request the rulebook refuses (``engine.requests.inbound.messages`` and friends).

    ``field`` names what is wrong as the caller spelled it (``messages[0].content[1].type``),
    so every door (the engine, both adapters, the server's 400s) reports the same field.
    Both a ``ValueError`` and a ``TypeError``: callers that caught either for bad input
    before the doors shared one rulebook still catch it.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str]]:
        # Pickled and copied with its field (args hold the message only).
        return type(self), (str(self), self.field)


class UnsupportedCombinationError(InvalidRequestError):
    """Two features a request combines (or a request feature and its engine's mode) that
    the engine does not serve together (``engine.compatibility`` says which, and why).
    ``features``: the two, by the compatibility table's names."""

    def __init__(self, message: str, field: str, features: tuple[str, str]) -> None:
        super().__init__(message, field)
        self.features = features

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str]]:
        return _unsupported, (str(self), self.field, *self.features)  # type: ignore[return-value]


def _unsupported(message: str, field: str, a: str, b: str) -> UnsupportedCombinationError:
    return UnsupportedCombinationError(message, field, (a, b))


class UnsupportedMediaError(InvalidRequestError):
    """An image (or other media) part for a model whose family's media this engine does not
    read: ``family`` is the checkpoint's ``model_type`` (None: a text-only model),
    ``reason`` says why (``engine.requests.inbound.vision_families``). Decided at load;
    the model still answers text."""

    def __init__(self, message: str, field: str, family: str | None, reason: str) -> None:
        super().__init__(message, field)
        self.family = family
        self.reason = reason

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str]]:
        return _unsupported_media, (str(self), self.field,  # type: ignore[return-value]
                                    self.family, self.reason)


def _unsupported_media(message: str, field: str, family: str | None,
                       reason: str) -> UnsupportedMediaError:
    return UnsupportedMediaError(message, field, family, reason)


class InvalidConstraintError(RequestError, ValueError):
    """The schema or grammar cannot be compiled, or a token broke it; the message says why."""


class RequestTimeoutError(RequestError, TimeoutError):
    """A request ran past its ``timeout``; its row was evicted."""


class RequestCancelledError(RequestError):
    """The request was cancelled before it produced its result (embeddings have no
    partial result to return, unlike a cancelled generation)."""


class InvalidModelError(ValueError):
    """A local path exists but is not a model: neither a model directory nor a ``.gguf``
    file, a corrupt config.json, or weights that do not fit the config."""


class ModelDownloadError(OSError):
    """The default model or a hub model could not be fetched; the message says what to do.

    An ``OSError``, like the ``FileNotFoundError`` of a missing path: what failed is
    getting the model's files."""


class UnsupportedModelError(ValueError):
    """A model this install cannot run: a ``model_type`` the installed mlx-lm has no
    architecture for, or a GGUF architecture, tensor type or tokenizer the converter
    cannot map."""


class OutputTruncatedError(ValueError):
    """``max_tokens`` cut an output that had to be complete: structured JSON, a forced call.

    Raised by the adapters (LangChain, LlamaIndex) in place of a parse error, so that the
    cause is said plainly: ``max_tokens``, the tokens generated, and what to raise.
    """

    def __init__(self, max_tokens: int, completion_tokens: int | None = None,
                 what: str = "the output") -> None:
        after = f" after {completion_tokens} tokens" if completion_tokens is not None else ""
        super().__init__(f"{what} was cut at max_tokens={max_tokens}{after} before it was "
                         "complete; raise max_tokens")
        self.max_tokens = max_tokens
        self.completion_tokens = completion_tokens
        self.what = what
