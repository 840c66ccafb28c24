"""Errors in OpenAI's JSON shape, and the one mapping from engine errors to HTTP statuses.

Every failure a client can cause is a 4xx whose body names the parameter, as OpenAI's API
does (``{"error": {"message", "type", "param", "code"}}``); clients such as the ``openai``
SDK turn that body into their own exception types by status code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from engine import (
    ContextLengthError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    InvalidConstraintError,
    InvalidRequestError,
    KVBudgetError,
    RequestTimeoutError,
)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client as ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def not_found(what: str, param: str | None = None) -> APIError:
    return APIError(404, what, param=param, code="not_found")


def param_path(loc: Sequence[int | str]) -> str:
    """A pydantic location as OpenAI writes a parameter: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = part
        elif part.startswith(("function-after", "function-before", "function-wrap")):
            continue  # validator frames pydantic inserts into union locations
        else:
            out += f".{part}"
    return out


def from_validation(exc: ValidationError, prefix: str = "") -> APIError:
    """The most specific problem of a pydantic validation error, naming its parameter.

    A value that matches no member of a union gets one error per member; the deepest
    location is the member the client meant (a list of items, not a string).
    """
    errors = exc.errors(include_url=False)
    first = max(errors, key=lambda e: len(e["loc"]))
    # Union members add their type names to the location; keep the request's own path.
    loc = [p for p in first["loc"] if not (isinstance(p, str) and _is_member_name(p))]
    param = param_path([*([prefix] if prefix else []), *loc]) or None
    message = str(first["msg"])
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def _is_member_name(part: str) -> bool:
    """A union member's name pydantic put in a location (a type or a model class name)."""
    return "[" in part or part in _TYPES or part[:1].isupper()


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance", "literal",
          "function-plain", "tagged-union"}


def field_renamed(message: str, field: str, param: str) -> str:
    """An engine message about ``field`` as a door that spells it ``param`` says it."""
    if field == param:
        return message
    return message.replace(field, param, 1) if field and field in message else (
        f"{param}: {message}")


def from_engine(exc: BaseException, *, prompt_param: str = "messages",
                constraint_param: str = "response_format",
                max_tokens_param: str = "max_tokens",
                fields: Callable[[str], str] | None = None) -> APIError:
    """The client's answer for an engine error raised by one request; ``fields`` spells
    the rulebook's field names (chat messages) as the endpoint's own request names them."""
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, KVBudgetError):
        return APIError(400, str(exc), param=max_tokens_param, code="context_length_exceeded")
    if isinstance(exc, InvalidConstraintError):
        return APIError(400, str(exc), param=constraint_param, code="invalid_value")
    if isinstance(exc, InvalidRequestError):  # the rulebook names the field itself
        if exc.field == "max_tokens":
            return APIError(400, str(exc), param=max_tokens_param, code="invalid_value")
        param = fields(exc.field) if fields is not None else exc.field
        return APIError(400, field_renamed(str(exc), exc.field, param), param=param,
                        code="invalid_value")
    if isinstance(exc, EngineDeadError | EngineClosedError):
        return APIError(503, f"the model is unavailable: {exc}", type=SERVER_ERROR,
                        code="engine_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), type=SERVER_ERROR, code="timeout")
    if isinstance(exc, EngineError):
        return APIError(500, f"generation failed: {exc}", type=SERVER_ERROR,
                        code=SERVER_ERROR)
    if isinstance(exc, ValueError | TypeError):
        return APIError(400, str(exc), param=_param_of_message(str(exc), max_tokens_param),
                        code="invalid_value")
    return APIError(500, f"generation failed: {exc!r}", type=SERVER_ERROR, code=SERVER_ERROR)


def _param_of_message(message: str, max_tokens_param: str) -> str | None:
    """The parameter an engine ``ValueError`` is about (its messages start with it)."""
    if message.startswith("SamplingParams."):
        field = message.split()[0].removeprefix("SamplingParams.")
        return max_tokens_param if field == "max_tokens" else field
    for param in ("tool_choice", "tools", "messages", "timeout"):
        if message.startswith(param) or f" {param}" in message.split(":")[0]:
            return param
    return None
