"""A thinking budget: after N reasoning tokens the grammar closes the reasoning block, then
the request's constraint (a schema, tools or a schema) holds for the answer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest

from engine import ChatRequest, Engine, JsonSchema, SamplingParams
from tests.engine.test_tools_or_answer import VERDICT
from tests.unit.test_tools import WEATHER

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def opening_engine(thinking_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[Engine]:
    """The tiny thinking model with a template that opens the reasoning block itself (as
    Qwen3's and DeepSeek-R1's do): the row's output starts inside it."""
    out = tmp_path_factory.mktemp("opening") / "model"
    shutil.copytree(thinking_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert "<think>" in config["chat_template"]
    config_path.write_text(json.dumps(config))
    with Engine(out) as eng:
        yield eng


def _no_close(eng: Engine) -> tuple:  # type: ignore[type-arg]
    """A logits processor that keeps the model from closing the block by itself."""
    close = eng.tokenizer.encode("</think>", add_special_tokens=False)
    return (lambda tokens, logits: logits.at[..., mx.array(close)].add(-1e4),)


@pytest.mark.parametrize("budget", [3, 10])
def test_reasoning_ends_at_the_budget_then_the_schema_holds(opening_engine: Engine,
                                                            budget: int) -> None:
    params = SamplingParams(max_tokens=120, constraint=JsonSchema(VERDICT),
                            reasoning_budget=budget, logits_processors=_no_close(opening_engine))
    result = opening_engine.submit(ChatRequest.from_openai(ASK, params)).result()
    reasoning_ids = opening_engine.tokenizer.encode(result.reasoning or "",
                                                    add_special_tokens=False)
    assert 0 < len(reasoning_ids) <= budget + 1  # re-encoding may split one token in two
    assert result.usage.reasoning_tokens == budget  # as generated: the markers aside
    jsonschema.validate(json.loads(result.content), VERDICT)


def test_without_a_budget_the_block_runs_to_max_tokens(opening_engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, logits_processors=_no_close(opening_engine))
    result = opening_engine.submit(ChatRequest.from_openai(ASK, params)).result()
    assert result.content == "" and result.reasoning


def test_a_budget_before_tools_or_a_schema(opening_engine: Engine) -> None:
    params = SamplingParams(max_tokens=120, constraint=JsonSchema(VERDICT), reasoning_budget=4,
                            logits_processors=_no_close(opening_engine))
    result = opening_engine.submit(ChatRequest.from_openai(
        ASK, params, tools=[WEATHER], parallel_tool_calls=False)).result()
    assert result.reasoning
    if result.tool_calls:
        assert [c.name for c in result.tool_calls] == ["get_weather"]
    else:
        jsonschema.validate(json.loads(result.content), VERDICT)


@pytest.mark.parametrize("budget", [0, 4])
def test_usage_counts_the_reasoning_tokens(opening_engine: Engine, budget: int) -> None:
    """``usage.reasoning_tokens``: the tokens before the block's close, its marker aside."""
    params = SamplingParams(max_tokens=30, reasoning_budget=budget,
                            logits_processors=_no_close(opening_engine))
    result = opening_engine.submit(ChatRequest.from_openai(ASK, params)).result()
    close = opening_engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(close) == 1 and close[0] in result.token_ids
    assert result.usage.reasoning_tokens == result.token_ids.index(close[0]) == budget
    assert result.usage.as_dict()["reasoning_tokens"] == budget


def test_a_row_that_never_reasons_counts_none(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(ChatRequest.from_openai(
        ASK, SamplingParams(max_tokens=8))).result()
    assert result.usage.completion_tokens > 0 and result.usage.reasoning_tokens == 0


# ----- a template that leaves opening the block to the model -------------------------

@pytest.fixture(scope="module")
def model_opening_engine(thinking_model_dir: Path) -> Iterator[Engine]:
    """The tiny thinking model as built: its generation prompt opens no block."""
    with Engine(thinking_model_dir) as eng:
        yield eng


def _opens_never_closes(eng: Engine) -> tuple:  # type: ignore[type-arg]
    """A logits processor that makes the model open ``<think>`` whenever the grammar lets
    it, and never close the block by itself."""
    [open_] = eng.tokenizer.encode("<think>", add_special_tokens=False)
    [close] = eng.tokenizer.encode("</think>", add_special_tokens=False)
    return (lambda tokens, logits: logits.at[..., open_].add(1e4).at[..., close].add(-1e4),)


def test_the_prompt_opens_no_block_here(model_opening_engine: Engine) -> None:
    prompt = model_opening_engine.tokenizer.apply_chat_template(ASK, tokenize=False,
                                                                add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("budget", [3, 10])
def test_a_model_opened_block_ends_at_the_budget_then_the_schema_holds(
        model_opening_engine: Engine, budget: int) -> None:
    eng = model_opening_engine
    params = SamplingParams(max_tokens=120, constraint=JsonSchema(VERDICT),
                            reasoning_budget=budget, logits_processors=_opens_never_closes(eng))
    result = eng.submit(ChatRequest.from_openai(ASK, params)).result()
    reasoning_ids = eng.tokenizer.encode(result.reasoning or "", add_special_tokens=False)
    assert 0 < len(reasoning_ids) <= budget + 1  # re-encoding may split one token in two
    assert result.usage.reasoning_tokens == budget  # as generated: the markers aside
    jsonschema.validate(json.loads(result.content), VERDICT)


def test_without_a_budget_the_model_opened_block_runs_to_max_tokens(
        model_opening_engine: Engine) -> None:
    eng = model_opening_engine
    params = SamplingParams(max_tokens=40, logits_processors=_opens_never_closes(eng))
    result = eng.submit(ChatRequest.from_openai(ASK, params)).result()
    assert result.content == "" and result.reasoning


@pytest.mark.parametrize("constraint", [None, JsonSchema(VERDICT)])
def test_budget_zero_lets_the_model_open_no_block(model_opening_engine: Engine,
                                                   constraint: JsonSchema | None) -> None:
    eng = model_opening_engine
    params = SamplingParams(max_tokens=40, constraint=constraint, reasoning_budget=0,
                            logits_processors=_opens_never_closes(eng))
    result = eng.submit(ChatRequest.from_openai(ASK, params)).result()
    assert not result.reasoning and "<think>" not in result.content
    if constraint is not None:
        jsonschema.validate(json.loads(result.content), VERDICT)
