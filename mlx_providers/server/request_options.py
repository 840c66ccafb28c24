"""A request body's options as the engine's ``SamplingParams``: one conversion for both
endpoints. Each of the engine's ``REQUEST_OPTIONS`` the body has a field for passes under
its own name; the endpoint gives what it names differently (``max_output_tokens``;
Responses' ``include`` asks for ``logprobs``) or defaults itself (the temperature)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from engine import REQUEST_OPTIONS, SamplingParams, sampling_from_options


def body_sampling(body: BaseModel, **given: Any) -> SamplingParams:
    """The body's request options, with ``given`` (resolved options, a constraint) over
    them; a field left unset (None) keeps the engine's default."""
    fields = type(body).model_fields
    options = {name: getattr(body, name) for name in REQUEST_OPTIONS if name in fields}
    fixed = {k: v for k, v in given.items() if k not in REQUEST_OPTIONS}
    options.update({k: v for k, v in given.items() if k in REQUEST_OPTIONS})
    return sampling_from_options(options, **fixed)
