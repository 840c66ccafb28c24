"""The loop guard on the real default model: greedy SmolLM2 loops inside a JSON string
without it, and writes complete, valid JSON with it, batched exactly as alone."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine import Engine, EngineConfig, FinishReason, SamplingParams
from engine.requests.inbound.output_constraint import JsonSchema
from tests.conftest import request_for

# The real default model decoding at length: make test-real (CI) runs it.
pytestmark = [pytest.mark.slow, pytest.mark.real]

JOKE = JsonSchema({"type": "object",
                   "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
                   "required": ["setup", "punchline"]})
CATS = [{"role": "user", "content": "Tell me a joke about cats."}]
OTHERS = [[{"role": "user", "content": f"Count to {n}."}] for n in (3, 5, 7)]


@pytest.fixture
def default_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The default model with ``json_string_ngram`` set to the test's parameter."""
    eng = Engine(None, EngineConfig(json_string_ngram=request.param)).start()
    yield eng
    eng.close()


def _repeated_4grams(eng: Engine, text: str) -> int:
    ids = list(eng.tokenizer.encode(text, add_special_tokens=False))
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize("default_engine", [0], indirect=True)
def test_greedy_json_string_loops_without_the_guard(default_engine: Engine) -> None:
    eng = default_engine
    result = eng.submit(request_for(CATS, SamplingParams(max_tokens=96, constraint=JOKE))).result()
    assert result.finish_reason is FinishReason.LENGTH
    assert _repeated_4grams(eng, result.text) > 10  # "a cat is a cat, a cat is a cat, ..."


@pytest.mark.parametrize("default_engine", [4], indirect=True)
def test_the_guard_ends_the_loop_and_batched_equals_alone(default_engine: Engine) -> None:
    eng = default_engine
    params = SamplingParams(max_tokens=256, constraint=JOKE)
    alone = eng.submit(request_for(CATS, params)).result()
    handles = [eng.submit(request_for(CATS, params)),
               *(eng.submit(request_for(p, SamplingParams(max_tokens=24))) for p in OTHERS)]
    batched = handles[0].result()
    for handle in handles[1:]:
        handle.result()
    assert alone.finish_reason is FinishReason.STOP
    joke = json.loads(alone.text)
    assert set(joke) == {"setup", "punchline"}
    for value in joke.values():
        assert _repeated_4grams(eng, value) == 0
    assert batched.token_ids == alone.token_ids
