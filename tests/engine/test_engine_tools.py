"""Tool calls: forced by grammar, parsed into calls, rendered with or without template help."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from engine import ChatRequest, Engine, FinishReason, SamplingParams
from engine.requests.inbound.output_constraint import LarkGrammar
from engine.requests.inbound.tool_specs import normalize_tool_choice, normalize_tools
from tests.conftest import greedy, prompt_renderer
from tests.unit.test_tools import WEATHER

CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
                   "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def params_of(tool: dict) -> dict:  # type: ignore[type-arg]
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


def test_required_tool_choice_produces_a_valid_call(tiny_engine: Engine) -> None:
    request = ChatRequest.from_openai(ASK, greedy(80), tools=[WEATHER, CLOCK],
                                      tool_choice="required", parallel_tool_calls=False)
    result = tiny_engine.submit(request).result()
    assert result.finish_reason is FinishReason.TOOL_CALLS, result.text
    assert len(result.tool_calls) == 1 and not result.invalid_tool_calls
    call = result.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    jsonschema.validate(call.arguments, params_of(tool))
    assert result.content.strip() == ""


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_produces_that_tool(tiny_engine: Engine, name: str) -> None:
    request = ChatRequest.from_openai(ASK, greedy(80), tools=[WEATHER, CLOCK],
                                      tool_choice=name, parallel_tool_calls=False)
    result = tiny_engine.submit(request).result()
    assert [c.name for c in result.tool_calls] == [name]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[name]
    jsonschema.validate(result.tool_calls[0].arguments, params_of(tool))


def test_any_is_required_and_none_omits_tools(tiny_engine: Engine) -> None:
    specs = normalize_tools([WEATHER])
    assert normalize_tool_choice("any", specs) == "required"
    none = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(20), tools=[WEATHER],
                                                      tool_choice="none")).result()
    plain = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(20))).result()
    assert none.token_ids == plain.token_ids
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_parallel_calls_parse_into_separate_calls_with_distinct_ids(tiny_engine: Engine) -> None:
    # Two different calls: a call repeating an earlier one would end the row instead.
    two_calls = LarkGrammar("start: " + ' "\\n" '.join(
        '<tool_call> "\\n{\\"name\\": \\"get_time\\", \\"arguments\\": '
        f'{{\\"tz\\": \\"{tz}\\"}}}}\\n" </tool_call>' for tz in ("UTC", "CET")))
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(80, constraint=two_calls),
                                                        tools=[CLOCK])).result()
    assert [c.name for c in result.tool_calls] == ["get_time", "get_time"]
    assert [c.arguments for c in result.tool_calls] == [{"tz": "UTC"}, {"tz": "CET"}]
    assert len({c.id for c in result.tool_calls}) == 2
    assert result.finish_reason is FinishReason.TOOL_CALLS and result.content == ""


def test_malformed_calls_are_reported_not_raised(tiny_engine: Engine) -> None:
    broken = LarkGrammar('start: "Sure. " <tool_call> "\\n{\\"name\\": oops\\n" </tool_call>')
    result = tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(40, constraint=broken),
                                                        tools=[WEATHER])).result()
    assert result.finish_reason is FinishReason.STOP
    assert result.tool_calls == () and len(result.invalid_tool_calls) == 1
    invalid = result.invalid_tool_calls[0]
    assert "oops" in invalid.raw and invalid.error
    assert result.content == "Sure. "


def test_tools_are_rendered_by_the_template_when_it_can(tiny_engine: Engine) -> None:
    renderer = prompt_renderer(tiny_engine)
    assert renderer.template_renders_tools()
    ids = renderer.encode_request(ASK, normalize_tools([WEATHER]), {}).ids
    text = tiny_engine.tokenizer.decode(ids)
    assert "# Tools" in text and "get_weather" in text


def without_tools_in_template(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model whose chat template ignores ``tools``."""
    shutil.copytree(model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config["chat_template"]
    start = template.index("{%- if tools -%}")
    end = template.index("{%- endif -%}", start) + len("{%- endif -%}")
    config["chat_template"] = template[:start] + template[end:]
    config_path.write_text(json.dumps(config))
    return out


def test_fallback_system_prompt_when_the_template_ignores_tools(
        make_engine, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(without_tools_in_template(tiny_model_dir, tmp_path / "no-tools"))
    renderer = prompt_renderer(eng)
    assert not renderer.template_renders_tools()
    messages = [{"role": "system", "content": "Be terse."}, *ASK]
    ids = renderer.encode_request(messages, normalize_tools([WEATHER]), {}).ids
    text = eng.tokenizer.decode(ids)
    assert "Be terse." in text and "<tools>" in text and "get_weather" in text
    assert "# Tools" not in text  # not the template's own tool section
    forced = eng.submit(ChatRequest.from_openai(messages, greedy(80), tools=[WEATHER],
                                                tool_choice="get_weather")).result()
    assert forced.tool_calls and forced.tool_calls[0].name == "get_weather"


def test_bad_tools_and_choices_raise_at_submit(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match="not among the tools"):
        tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(), tools=[WEATHER],
                                                   tool_choice="nope"))
    with pytest.raises(ValueError, match="function name"):
        tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(),
                                                   tools=[{"type": "function", "function": {}}]))
    with pytest.raises(ValueError, match="needs at least one tool"):
        tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(), tool_choice="required"))
    bad_schema = {"type": "function", "function": {"name": "x",
                                                   "parameters": {"type": "bogus"}}}
    with pytest.raises(ValueError, match="JSON schema"):
        tiny_engine.submit(ChatRequest.from_openai(ASK, greedy(), tools=[bad_schema],
                                                   tool_choice="required"))


def test_reasoning_is_returned_apart_from_content(thinking_model_dir) -> None:  # type: ignore[no-untyped-def]
    with Engine(thinking_model_dir) as eng:
        assert eng.tokenizer.has_thinking
        grammar = LarkGrammar('start: <think> "let me see" </think> "It is sunny."')
        params = SamplingParams(max_tokens=30, constraint=grammar)
        events = list(eng.submit(ChatRequest.from_openai(ASK, params)))
        result = events[-1].completion
        assert result is not None
        assert result.reasoning == "let me see" and result.content == "It is sunny."
        assert "".join(e.reasoning for e in events) == "let me see"
        assert "".join(e.content for e in events) == "It is sunny."
