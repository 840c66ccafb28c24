"""SamplingParams and EngineConfig validation: clear errors naming the field."""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -1), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0), ("repetition_penalty", 0),
    ("seed", "x"), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("top_logprobs", 50), ("logprobs", "yes"), ("logits_processors", [1]),
])
def test_bad_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_normalise_sequences() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[5, 6])  # type: ignore[arg-type]
    assert params.stop == ("END",) and params.stop_token_ids == (5, 6)
    assert params.greedy and not params.needs_serial_lane
    assert SamplingParams(temperature=0.7, seed=3).needs_serial_lane
    assert not SamplingParams(temperature=0.0, seed=3).needs_serial_lane


@pytest.mark.parametrize(("field", "value"), [
    ("max_batch", 0), ("prefill_chunk", 1), ("kv_budget_bytes", 0), ("bogus", 1),
])
def test_bad_engine_config_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_top_logprobs_without_logprobs_is_refused_naming_it() -> None:
    # OpenAI's rule: alternatives come only with the chosen tokens' logprobs.
    with pytest.raises(ValueError, match=r"SamplingParams\.top_logprobs needs logprobs=True"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert not SamplingParams(top_logprobs=0).logprobs
