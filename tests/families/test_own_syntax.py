"""Every family in its own tool and reasoning syntax, on its real tokenizer and template.

For each family of the catalog (``testkit.families``, what it expects of each family): the
tokenizer picks the family's dialect; the template writes the call as the family writes it
(where it renders calls); the forced-call grammar compiles on the real tokenizer and
accepts the family's native call; a grammar-forced call through the Engine on the tiny
family model is written in the family's own syntax (closing a reasoning block the prompt
opened first) and comes back parsed with arguments valid for the schema and no markup in
content, for "required" and a named tool, parallel calls on and off; a second turn renders
the past call and its result with the real template (a template that renders no calls gets
them written by the engine), also under another provider's call id; and reasoning, forced
as the family writes it, lands in its channel with the answer alone in content. Templates
that refuse system messages get the tool prompt in the first user turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import ChatRequest, Engine, FinishReason, LarkGrammar
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.outbound.channels import REASONING
from engine.requests.prepare import Preparer
from testkit.families import Family
from testkit.families.transcripts import CALL_ID, QUESTION, WEATHER_TOOL, tool_call_message
from testkit.forcing import forcing
from tests.conftest import greedy

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
ASK = [{"role": "user", "content": QUESTION}]
RESULT = "22 degrees and sunny"
FOREIGN_ID = "call_0123456789abcdefghijklmn"  # another provider's id: not 9 alphanumerics


@pytest.fixture(scope="module")
def preparer(family: Family, family_engine: Engine, family_dir: Path) -> Preparer:
    """The engine's request preparation, as its thread builds it (the prompt it renders)."""
    return Preparer(family_engine.tokenizer, family_dir, family.vocab_size)


def _lead(preparer: Preparer, start_channel: str) -> str:
    """What a forced call writes first: the close of a reasoning block the prompt opened."""
    dialect = preparer.dialect
    return f"{dialect.reasoning_close}{dialect.after_reasoning}" if (
        start_channel == REASONING) else ""


def test_the_family_speaks_its_dialect(family: Family, family_engine: Engine) -> None:
    dialect = dialect_for(TokenizerFacts.of(family_engine.tokenizer))
    assert dialect.name == family.expected.dialect


def test_the_template_writes_the_call_as_the_family_does(family: Family,
                                                        family_engine: Engine) -> None:
    if family.expected.template_call is None:
        pytest.skip(f"{family.name}'s template renders no tool calls")
    history = [{"role": "user", "content": QUESTION}, tool_call_message()]
    text = family_engine.tokenizer.apply_chat_template(history, tools=[WEATHER_TOOL],
                                                       tokenize=False)
    assert family.expected.template_call in text


def test_tools_reach_a_template_that_refuses_system_messages(
        family: Family, family_engine: Engine, preparer: Preparer) -> None:
    if not family.expected.refuses_system:
        pytest.skip(f"{family.name}'s template takes a system message")
    tokenizer = family_engine.tokenizer
    with pytest.raises(Exception, match="System role not supported"):  # the template itself
        tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK],
                                      tokenize=False)
    request = ChatRequest.from_openai([{"role": "system", "content": "Be brief."}, *ASK],
                                      greedy(4), tools=[WEATHER_TOOL])
    prompt = tokenizer.decode(preparer.prepare(request).prompt_ids)
    user_turn = prompt.split("<start_of_turn>user\n", 1)[1].split("<end_of_turn>", 1)[0]
    assert user_turn.startswith("Be brief.\n\nYou have access to the following tools")
    assert '"get_weather"' in user_turn and user_turn.endswith(ASK[0]["content"])
    assert family_engine.submit(request).result(timeout=60).token_ids


@pytest.mark.parametrize("parallel", [True, False])
def test_the_forced_grammar_accepts_the_native_call(family: Family, family_engine: Engine,
                                                   preparer: Preparer, parallel: bool) -> None:
    request = ChatRequest.from_openai(ASK, greedy(8), tools=[WEATHER_TOOL],
                                      tool_choice="required", parallel_tool_calls=parallel)
    prepared = preparer.prepare(request)
    assert isinstance(prepared.params.constraint, LarkGrammar)
    matcher = preparer.compiler.compile(prepared.params.constraint).deep_copy()
    text = _lead(preparer, prepared.start_channel) + family.expected.native_call
    ids = preparer.compiler.token_ids(text)  # as the model writes it (no SentencePiece "▁")
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


# "required" and a named tool (by name and in OpenAI's object form), parallel calls on and
# off.
@pytest.mark.parametrize(("choice", "parallel"), [
    ("required", True), ("required", False), ("get_time", False),
    ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_a_forced_call_is_written_in_the_familys_syntax_and_parsed(
        family: Family, family_engine: Engine, preparer: Preparer, choice: Any,
        parallel: bool) -> None:
    request = ChatRequest.from_openai(ASK, greedy(160), tools=[WEATHER, CLOCK],
                                      tool_choice=choice, parallel_tool_calls=parallel)
    # The family's call up to the tool's name, after the close of an opened reasoning block.
    start = (_lead(preparer, preparer.prepare(request).start_channel)
             + family.expected.native_call.partition("get_weather")[0])
    result = family_engine.submit(request).result(timeout=120)
    assert result.text.lstrip().startswith(start.lstrip()), result.text
    assert result.finish_reason == FinishReason.TOOL_CALLS, (result.text,
                                                             result.invalid_tool_calls)
    assert result.tool_calls and not result.invalid_tool_calls
    assert parallel or len(result.tool_calls) == 1
    named = choice if isinstance(choice, str) else choice["function"]["name"]
    tools = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in result.tool_calls:
        assert named == "required" or call.name == named
        assert _valid(call.arguments, tools[call.name]), call
    assert result.content == "" and not result.reasoning, "markup leaked into content"


def test_a_second_turn_renders_the_past_call_and_its_result(
        family: Family, family_engine: Engine, preparer: Preparer) -> None:
    history = [*ASK, tool_call_message(),
               {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
                "content": RESULT}]
    request = ChatRequest.from_openai(history, greedy(4), tools=[WEATHER_TOOL])
    prompt = family_engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
    assert RESULT in prompt
    past = prompt.split(QUESTION, 1)[1]  # the call is in the history after the question
    assert family.expected.past_call in past and "Paris" in past
    assert family_engine.submit(request).result(timeout=60).token_ids


def test_a_second_turn_under_another_providers_call_id_renders_the_result(
        family: Family, family_engine: Engine, preparer: Preparer) -> None:
    history = [*ASK,
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": FOREIGN_ID, "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": FOREIGN_ID, "content": RESULT}]
    request = ChatRequest.from_openai(history, greedy(4), tools=[WEATHER, CLOCK])
    prompt = family_engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
    assert RESULT in prompt
    assert family_engine.submit(request).result(timeout=120).token_ids


def test_reasoning_goes_to_its_channel_and_the_answer_to_content(
        family: Family, family_engine: Engine, preparer: Preparer) -> None:
    reasoning = family.expected.reasoning
    if reasoning is None:
        pytest.skip(f"{family.name} has no reasoning syntax")
    # A turn that reasons then answers, as the family writes it after its prompt (with the
    # template switch that turns thinking on), forced token by token so the tiny model
    # writes it (a constraint describes the answer alone).
    ask = ChatRequest.from_openai(ASK, greedy(1), chat_template_kwargs=reasoning.switches)
    opened = preparer.prepare(ask).start_channel == REASONING
    text = reasoning.turn("Hmm.", "Hi.", opened=opened)
    ids = family_engine.tokenizer.encode(text, add_special_tokens=False)
    request = ChatRequest.from_openai(
        ASK, greedy(len(ids), logits_processors=(forcing(ids),)),
        chat_template_kwargs=reasoning.switches)
    result = family_engine.submit(request).result(timeout=60)
    assert (result.reasoning or "").strip() == "Hmm."
    assert result.content == "Hi."  # the template's "\n\n" after </think> is not content


def test_harmony_reasoning_effort_reaches_the_template(family: Family, family_engine: Engine,
                                                      preparer: Preparer) -> None:
    if family.expected.dialect != "harmony":
        pytest.skip("only harmony templates (gpt-oss's) read reasoning_effort")
    for effort in ("low", "high"):
        request = ChatRequest.from_openai(ASK, greedy(2),
                                          chat_template_kwargs={"reasoning_effort": effort})
        prompt = family_engine.tokenizer.decode(preparer.prepare(request).prompt_ids)
        assert f"Reasoning: {effort}" in prompt
