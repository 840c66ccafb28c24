"""A face's sampling settings for one call: its fields, with the call's overrides.

Both faces expose the engine's ``REQUEST_OPTIONS`` as fields (defaults) and as per-call
keyword arguments; ``SamplingParams`` validates the result, naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def call_sampling(defaults: object, call: Mapping[str, Any],
                  names: Iterable[str]) -> dict[str, Any]:
    """Each of ``names`` from ``call`` if given there, else ``defaults``' attribute.

    A call that turns logprobs off without naming ``top_logprobs`` leaves the fields'
    ``top_logprobs`` behind with them (alternatives come only with logprobs); fields, or a
    call, that set ``top_logprobs`` without logprobs are refused by ``SamplingParams``,
    as OpenAI refuses it.
    """
    settings = {name: call.get(name, getattr(defaults, name)) for name in names}
    if "top_logprobs" in settings and call.get("logprobs") is False \
            and "top_logprobs" not in call:
        settings["top_logprobs"] = 0
    return settings
