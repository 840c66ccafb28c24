"""Errors the engine raises; each names what went wrong and what to do."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not complete a request (the cause is in ``__cause__``)."""


class EngineDeadError(EngineError):
    """The engine thread died; every waiter and every later submit gets this."""


class EngineClosedError(EngineError):
    """The engine was closed before or while the request ran."""


class ContextLengthError(ValueError):
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


class KVBudgetError(ValueError):
    """A request's worst-case KV cache would not fit in the budget even alone."""

    def __init__(self, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"request needs up to {needed_bytes} KV-cache bytes (prompt + max_tokens) but "
            f"EngineConfig.kv_budget_bytes is {budget_bytes}; lower max_tokens, shorten the "
            "prompt or raise the budget"
        )
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class RequestTimeoutError(TimeoutError):
    """A request ran past its ``timeout``; its row was evicted."""
