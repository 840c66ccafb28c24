"""Qwen3.5, Gemma 4, LFM2 and gpt-oss in their own tool syntax, on their real tokenizers and
templates (and Gemma 3, which has none, in the default one, its tool prompt in the first
user turn since its template refuses system messages).

For each: the tokenizer picks the family's dialect; the forced-call grammar compiles on the
real tokenizer and accepts the call exactly as the family writes it (as its template
renders a call, or as documented where the template renders none); a grammar-forced call
through the Engine on the tiny family model comes back parsed (finish_reason tool_calls,
arguments valid for the schema), for "required" and a named tool, parallel on and off; and
a second turn renders the past call and its result with the real template (LFM2's template
renders no calls: its dialect writes them into the assistant turn).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, EngineConfig, FinishReason, LarkGrammar
from engine.requests.dialects.dialect import Dialect, TokenizerFacts
from engine.requests.dialects.gemma4 import Gemma4
from engine.requests.dialects.harmony import Harmony
from engine.requests.dialects.pythonic import Pythonic
from engine.requests.dialects.qwen_xml import QwenXml
from engine.requests.dialects.registry import dialect_for
from engine.requests.outbound.channels import REASONING
from engine.requests.prepare import Preparer
from testkit.families import FAMILIES
from testkit.families.transcripts import CALL_ID, QUESTION, WEATHER_TOOL, tool_call_message
from testkit.forcing import forcing
from tests.conftest import greedy

# Each family's dialect, and one get_weather(city="Paris") call as the family writes it.
NATIVE: dict[str, tuple[type[Dialect], str]] = {
    "qwen3_5": (QwenXml, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                         "</parameter>\n</function>\n</tool_call>"),
    "gemma4": (Gemma4, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'),
    # LFM2's template renders no tool_calls: its documented form.
    "lfm2": (Pythonic, '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'),
    # gpt-oss's template renders the recipient before the channel; its forced calls use the
    # form OpenAI's harmony guide shows the model writing (both are read back).
    "gpt_oss": (Harmony, '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                         '<|message|>{"city": "Paris"}<|call|>'),
    "gemma3": (Dialect, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                        '\n</tool_call>'),
}
RENDERS_CALLS = ("qwen3_5", "gemma4")  # the template writes a call in history exactly so
# Gemma 3's stand-in template (Gemma 2's) renders no tools and refuses a system message:
# the tool prompt goes before the first user turn instead.
REFUSES_SYSTEM = ("gemma3",)

# Forced values are enums and booleans, so a random model's forced call always ends (an
# unbounded number or free string may run to max_tokens); one optional argument.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "metric": {"type": "boolean"}, "note": {"type": "string", "enum": ["x"]}},
        "required": ["city", "metric"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
        "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=sorted(NATIVE))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(name: str, family_model_dir: Callable[[str], Path]) -> Iterator[Engine]:
    eng = Engine(family_model_dir(name), EngineConfig(max_batch=4)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def preparer(name: str, engine: Engine, family_model_dir: Callable[[str], Path]) -> Preparer:
    return Preparer(engine.tokenizer, family_model_dir(name), FAMILIES[name].vocab_size)


def test_the_family_speaks_its_dialect(name: str, engine: Engine) -> None:
    assert type(dialect_for(TokenizerFacts.of(engine.tokenizer))) is NATIVE[name][0]


def test_the_template_writes_the_native_call(name: str, engine: Engine) -> None:
    if name not in RENDERS_CALLS:
        pytest.skip(f"{name}'s template renders no tool calls of this form")
    history = [{"role": "user", "content": QUESTION}, tool_call_message()]
    text = engine.tokenizer.apply_chat_template(history, tools=[WEATHER_TOOL], tokenize=False)
    assert NATIVE[name][1] in text


def test_tools_reach_a_template_that_refuses_system_messages(name: str, engine: Engine,
                                                            preparer: Preparer) -> None:
    if name not in REFUSES_SYSTEM:
        pytest.skip(f"{name}'s template takes a system message")
    with pytest.raises(Exception, match="System role not supported"):  # the template itself
        engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK],
                                             tokenize=False)
    request = ChatRequest.from_openai([{"role": "system", "content": "Be brief."}, *ASK],
                                      greedy(4), tools=[WEATHER_TOOL])
    prompt = engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
    user_turn = prompt.split("<start_of_turn>user\n", 1)[1].split("<end_of_turn>", 1)[0]
    assert user_turn.startswith("Be brief.\n\nYou have access to the following tools")
    assert '"get_weather"' in user_turn and user_turn.endswith(ASK[0]["content"])
    assert engine.submit(request).result(timeout=60).token_ids


@pytest.mark.parametrize("parallel", [True, False])
def test_the_forced_grammar_accepts_the_native_call(name: str, engine: Engine,
                                                   preparer: Preparer, parallel: bool) -> None:
    request = ChatRequest.from_openai(ASK, greedy(8), tools=[WEATHER_TOOL],
                                      tool_choice="required", parallel_tool_calls=parallel)
    prepared = preparer.prepare(request)
    assert isinstance(prepared.params.constraint, LarkGrammar)
    dialect = preparer.dialect
    lead = ""
    if prepared.start_channel == REASONING:  # Qwen3.5's prompt opened <think>
        lead = f"{dialect.reasoning_close}{dialect.after_reasoning}"
    matcher = preparer.compiler.compile(prepared.params.constraint).deep_copy()
    ids = engine.tokenizer.encode(lead + NATIVE[name][1], add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids), matcher.get_error()
    assert matcher.is_accepting()


def _valid(arguments: dict[str, Any], tool: dict[str, Any]) -> bool:
    params = tool["function"]["parameters"]
    properties = params["properties"]
    if set(arguments) - set(properties) or set(params["required"]) - set(arguments):
        return False
    kinds = {"string": str, "boolean": bool}
    for key, value in arguments.items():
        schema = properties[key]
        if not isinstance(value, kinds[schema["type"]]):
            return False
        if "enum" in schema and value not in schema["enum"]:
            return False
    return True


# "required" with parallel calls on and off, and a named tool once: a named tool with parallel
# calls on writes the same syntax as "required" does.
@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False),
                                                  ("get_time", False)])
def test_a_forced_call_comes_back_parsed(name: str, engine: Engine, choice: str,
                                         parallel: bool) -> None:
    request = ChatRequest.from_openai(ASK, greedy(96), tools=[WEATHER, CLOCK],
                                      tool_choice=choice, parallel_tool_calls=parallel)
    result = engine.submit(request).result(timeout=120)
    assert result.finish_reason == FinishReason.TOOL_CALLS, (result.finish_reason,
                                                             result.text)
    assert result.tool_calls and not result.invalid_tool_calls
    assert parallel or len(result.tool_calls) == 1
    tools = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in result.tool_calls:
        assert choice == "required" or call.name == choice
        assert _valid(call.arguments, tools[call.name]), call
    assert result.content.strip() == "", "call markup leaked into content"


def test_a_second_turn_renders_the_tool_result(name: str, engine: Engine,
                                               preparer: Preparer) -> None:
    history = [{"role": "user", "content": QUESTION}, tool_call_message(),
               {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
                "content": "22 degrees and sunny"}]
    request = ChatRequest.from_openai(history, greedy(4), tools=[WEATHER_TOOL])
    prompt = engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
    assert "22 degrees and sunny" in prompt
    past = prompt.split(QUESTION, 1)[1]  # the call is in the history after the question
    if name in (*RENDERS_CALLS, "lfm2"):  # LFM2's is written into the turn's content
        assert NATIVE[name][1] in past
    assert "Paris" in past
    assert engine.submit(request).result(timeout=60).token_ids


# A turn that reasons then answers, as each family writes it after its prompt (with the
# template switch that turns thinking on), forced token by token so the tiny model writes
# it (a constraint describes the answer alone).
REASONED: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3_5": ({}, "Hmm.\n</think>\n\nHi."),  # the prompt opened <think>
    "gemma4": ({"enable_thinking": True}, "<|channel>thought\nHmm.<channel|>Hi."),
    "gpt_oss": ({"reasoning_effort": "high"},
                "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
                "<|channel|>final<|message|>Hi."),
}


def test_reasoning_goes_to_its_channel_and_the_answer_to_content(
        name: str, engine: Engine, preparer: Preparer) -> None:
    if name not in REASONED:
        pytest.skip(f"{name} has no reasoning syntax")
    switches, text = REASONED[name]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    request = ChatRequest.from_openai(
        ASK, greedy(len(ids), logits_processors=(forcing(ids),)),
        chat_template_kwargs=switches)
    result = engine.submit(request).result(timeout=60)
    assert (result.reasoning or "").strip() == "Hmm."
    assert result.content == "Hi."  # the template's "\n\n" after </think> is not content


def test_gpt_oss_reasoning_effort_reaches_the_template(name: str, engine: Engine,
                                                      preparer: Preparer) -> None:
    if name != "gpt_oss":
        pytest.skip("only gpt-oss's template reads reasoning_effort")
    for effort in ("low", "high"):
        request = ChatRequest.from_openai(ASK, greedy(2),
                                          chat_template_kwargs={"reasoning_effort": effort})
        prompt = engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
        assert f"Reasoning: {effort}" in prompt
