"""The reasoning budget and the answer frame as grammar, on real vocabularies (no model).

``TurnGrammar``'s constraint for a chat turn (as ``Preparer`` builds it), compiled by
llguidance over Qwen3's and gpt-oss's tokenizers (the family kit's, from the
llama-cpp-python sdist), and checked over token ids: what the grammar admits whole, and where
it stops a text it refuses.

- A template that leaves opening ``<think>`` to the model (Qwen3 without a thinking
  prompt): with a budget N the model may open the block and reason at most N tokens, or
  skip it; budget 0 admits no block; then the answer (JSON, free text, a call) follows.
- gpt-oss (harmony): a JSON answer is a message on the final channel; the union of calls
  and answer has both branches in harmony; the budget bounds an optional analysis message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.requests.constraints.reasoning_budget import budgeted_answer, optional_reasoning
from engine.requests.dialects.harmony import Harmony, HarmonySplitter
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.output_constraint import Constraint, JsonSchema, LarkGrammar
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.prepare import Preparer
from testkit.families import FAMILIES, AssetUnavailable, family_tokenizer

VERDICT = {"type": "object", "properties": {"answer": {"enum": ["sunny", "rainy"]}},
           "required": ["answer"]}
ANSWER = '{"answer": "sunny"}'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT = "The user asks about Paris."  # fewer than 8 tokens in both vocabularies
LONG = " ".join(["Let me think about the weather in Paris carefully."] * 4)

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HARMONY_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                '<|message|>{"city": "Paris"}<|call|>')
ANALYSIS = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"


class _Wrapper:
    """What ``Preparer`` reads of mlx-lm's ``TokenizerWrapper``, over a real tokenizer."""

    def __init__(self, hf: Any, think: tuple[str, str] | None) -> None:
        self._tokenizer = hf
        self.chat_template = ""
        self.has_tool_calling = False
        self.has_thinking = think is not None
        self.think_start, self.think_end = think or ("", "")
        self.eos_token_ids = {hf.eos_token_id}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab())


def _preparer(name: str, think: tuple[str, str] | None) -> Preparer:
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[name]
    try:
        tokenizer = family_tokenizer(family)
    except AssetUnavailable as exc:
        pytest.skip(f"{name}: its vocabulary's source is missing: {exc}")
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                 eos_token=family.tokenizer_config["eos_token"])
    return Preparer(_Wrapper(hf, think), Path("."), family.vocab_size)


@pytest.fixture(scope="module")
def qwen3() -> Preparer:
    return _preparer("qwen3", ("<think>", "</think>"))


@pytest.fixture(scope="module")
def qwen3_plain() -> Preparer:
    """Qwen3's vocabulary seen as a model without reasoning markers."""
    return _preparer("qwen3", None)


@pytest.fixture(scope="module")
def gpt_oss() -> Preparer:
    return _preparer("gpt_oss", None)


def constraint(preparer: Preparer, *, schema: dict[str, Any] | None = VERDICT,
               budget: int | None = None, tools: Sequence[dict[str, Any]] = (),
               choice: str = "auto", opens_reasoning: bool = False) -> Constraint | None:
    params = SamplingParams(max_tokens=64, reasoning_budget=budget,
                            constraint=JsonSchema(schema) if schema else None)
    request = ChatRequest.from_openai(ASK, params, tools=list(tools) or None,
                                      tool_choice=choice)
    return preparer.turn_grammar.constraint(request, opens_reasoning)


def consumed(preparer: Preparer, grammar: Constraint | None, text: str) -> tuple[int, int]:
    """(tokens of ``text`` the grammar takes, tokens of ``text``); (-1, n) when it takes
    them all but is not complete there."""
    assert grammar is not None
    matcher = preparer.compiler.compile(grammar).deep_copy()
    ids = preparer.compiler._hf_tokenizer.encode(text, add_special_tokens=False)
    taken = matcher.try_consume_tokens(ids)
    return (taken if taken < len(ids) or matcher.is_accepting() else -1), len(ids)


def admits(preparer: Preparer, grammar: Constraint | None, text: str) -> bool:
    taken, total = consumed(preparer, grammar, text)
    return taken == total


def think(text: str) -> str:
    return f"<think>{text}</think>\n\n"


def tokens(preparer: Preparer, text: str) -> int:
    return len(preparer.compiler._hf_tokenizer.encode(text, add_special_tokens=False))


# ----- a block the model opens itself (Qwen3 without a thinking prompt) ---------------

def test_the_model_may_open_a_bounded_block_or_skip_it(qwen3: Preparer) -> None:
    grammar = constraint(qwen3, budget=8)
    assert tokens(qwen3, SHORT) <= 8 < tokens(qwen3, LONG)
    assert admits(qwen3, grammar, think(SHORT) + ANSWER)
    assert admits(qwen3, grammar, ANSWER)  # reasoning skipped
    assert admits(qwen3, grammar, think("") + ANSWER)
    taken, _ = consumed(qwen3, grammar, think(LONG) + ANSWER)
    assert taken == 1 + 8  # <think>, then 8 tokens of reasoning: the 9th is refused
    assert not admits(qwen3, grammar, think(SHORT) + "It is sunny.")  # the schema holds


def test_at_the_budget_only_the_close_may_follow(qwen3: Preparer) -> None:
    grammar = constraint(qwen3, budget=4)
    matcher = qwen3.compiler.compile(grammar).deep_copy()
    ids = qwen3.compiler._hf_tokenizer.encode("<think>" + LONG, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids[:5]) == 5
    forced = qwen3.compiler._hf_tokenizer.decode(matcher.compute_ff_tokens())
    assert forced.startswith("</think>\n\n")


def test_budget_zero_admits_no_block(qwen3: Preparer) -> None:
    assert constraint(qwen3, budget=0) == JsonSchema(VERDICT)  # the schema, as without one
    grammar = constraint(qwen3, schema=None, budget=0)
    assert admits(qwen3, grammar, "It is sunny.")
    assert not admits(qwen3, grammar, think("") + "It is sunny.")
    assert consumed(qwen3, grammar, think(SHORT))[0] == 0


def test_free_text_after_a_bounded_block(qwen3: Preparer) -> None:
    grammar = constraint(qwen3, schema=None, budget=8)
    assert admits(qwen3, grammar, think(SHORT) + "It is sunny.")
    assert admits(qwen3, grammar, "It is sunny.")
    assert consumed(qwen3, grammar, think(LONG) + "It is sunny.")[0] == 1 + 8


def test_a_forced_call_or_the_union_after_a_bounded_block(qwen3: Preparer) -> None:
    forced = constraint(qwen3, schema=None, budget=8, tools=[WEATHER], choice="required")
    assert admits(qwen3, forced, think(SHORT) + QWEN_CALL)
    assert admits(qwen3, forced, QWEN_CALL)
    assert consumed(qwen3, forced, think(LONG) + QWEN_CALL)[0] == 1 + 8
    union = constraint(qwen3, budget=8, tools=[WEATHER])
    assert admits(qwen3, union, think(SHORT) + QWEN_CALL)
    assert admits(qwen3, union, think(SHORT) + ANSWER)
    # Tools beside free text: the budget's grammar keeps the call branch.
    text = constraint(qwen3, schema=None, budget=8, tools=[WEATHER])
    assert admits(qwen3, text, think(SHORT) + QWEN_CALL)
    assert admits(qwen3, text, think(SHORT) + "It is sunny.")


def test_without_a_budget_nothing_changes(qwen3: Preparer) -> None:
    assert constraint(qwen3, schema=None) is None
    assert constraint(qwen3) == JsonSchema(VERDICT)
    assert constraint(qwen3, schema=None, tools=[WEATHER]) is None


def test_without_reasoning_markers_the_budget_does_nothing(qwen3_plain: Preparer) -> None:
    assert qwen3_plain.dialect.model_reasoning is None
    assert constraint(qwen3_plain, budget=8) == JsonSchema(VERDICT)
    assert constraint(qwen3_plain, schema=None, budget=8) is None
    assert constraint(qwen3_plain, schema=None, budget=8, tools=[WEATHER]) is None


def test_a_block_the_prompt_opened_is_still_closed_within_the_budget(qwen3: Preparer) -> None:
    grammar = constraint(qwen3, budget=8, opens_reasoning=True)
    assert admits(qwen3, grammar, f"{SHORT}</think>\n\n{ANSWER}")
    assert not admits(qwen3, grammar, ANSWER)  # the block is open: it must close first
    assert consumed(qwen3, grammar, f"{LONG}</think>\n\n{ANSWER}")[0] == 8


def test_the_optional_block_s_lark() -> None:
    prefix = optional_reasoning('"<o>"', '"<c>"', '"\\n"', 5)
    assert prefix.start == "reasoning?"
    assert 'reasoning: "<o>" thinking "<c>" "\\n"' in prefix.rules
    assert "thinking[max_tokens=5]" in prefix.rules
    assert optional_reasoning('"<o>"', '"<c>"', '""', 0).start == ""
    grammar = budgeted_answer(None, prefix, '"A:"')
    assert grammar == LarkGrammar(f'start: reasoning? answer\nanswer: "A:" answer_body\n'
                                  f"answer_body: /(?s:.*)/\n{prefix.rules}")


# ----- gpt-oss: harmony headers around the answer, analysis as reasoning --------------

def read(text: str) -> RowChannels:
    """The admitted text as a gpt-oss row reads it (``<|return|>``/``<|call|>`` end it)."""
    channels = RowChannels(HarmonySplitter(), None, ChatRequest.from_openai(
        ASK, SamplingParams(), tools=[WEATHER]).tools)
    channels.feed(text)
    channels.finish()
    return channels


def test_harmony_s_hooks(gpt_oss: Preparer) -> None:
    dialect = gpt_oss.dialect
    assert isinstance(dialect, Harmony)
    assert dialect.answer_head == FINAL
    marks = dialect.model_reasoning
    assert (marks.open, marks.close, marks.after) == ("<|channel|>analysis<|message|>",
                                                      "<|end|>", "<|start|>assistant")
    # <|return|> after the answer is an end of sequence, as for gpt-oss.
    assert gpt_oss.compiler._hf_tokenizer.eos_token == "<|return|>"


def test_a_json_answer_is_a_final_message(gpt_oss: Preparer) -> None:
    grammar = constraint(gpt_oss)
    assert admits(gpt_oss, grammar, FINAL + ANSWER)
    assert not admits(gpt_oss, grammar, ANSWER)  # no bare JSON: it would be header text
    assert not admits(gpt_oss, grammar, ANALYSIS.format(SHORT) + FINAL + ANSWER)
    channels = read(FINAL + ANSWER)
    assert json.loads(channels.content) == {"answer": "sunny"} and channels.reasoning == ""


def test_the_budget_bounds_an_optional_analysis_message(gpt_oss: Preparer) -> None:
    grammar = constraint(gpt_oss, budget=8)
    assert tokens(gpt_oss, SHORT) <= 8 < tokens(gpt_oss, LONG)
    text = ANALYSIS.format(SHORT) + FINAL + ANSWER
    assert admits(gpt_oss, grammar, text)
    assert admits(gpt_oss, grammar, FINAL + ANSWER)
    assert consumed(gpt_oss, grammar, ANALYSIS.format(LONG) + FINAL + ANSWER)[0] == 3 + 8
    channels = read(text)
    assert channels.reasoning == SHORT and json.loads(channels.content) == {"answer": "sunny"}
    none = constraint(gpt_oss, budget=0)
    assert admits(gpt_oss, none, FINAL + ANSWER)
    assert not admits(gpt_oss, none, text)


def test_the_union_s_call_and_answer_branches(gpt_oss: Preparer) -> None:
    union = constraint(gpt_oss, tools=[WEATHER])
    assert admits(gpt_oss, union, HARMONY_CALL)
    assert admits(gpt_oss, union, FINAL + ANSWER)
    assert not admits(gpt_oss, union, ANSWER)
    assert not admits(gpt_oss, union, FINAL + '{"answer": "foggy"}')
    budgeted = constraint(gpt_oss, tools=[WEATHER], budget=8)
    assert admits(gpt_oss, budgeted, ANALYSIS.format(SHORT) + HARMONY_CALL)
    assert admits(gpt_oss, budgeted, ANALYSIS.format(SHORT) + FINAL + ANSWER)
    channels = read(ANALYSIS.format(SHORT) + HARMONY_CALL)
    assert [(c.name, c.arguments) for c in channels.calls] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert channels.reasoning == SHORT and channels.content == ""


def test_a_forced_call_after_a_bounded_analysis(gpt_oss: Preparer) -> None:
    forced = constraint(gpt_oss, schema=None, tools=[WEATHER], choice="required", budget=8)
    assert admits(gpt_oss, forced, ANALYSIS.format(SHORT) + HARMONY_CALL)
    assert admits(gpt_oss, forced, HARMONY_CALL)
    assert not admits(gpt_oss, forced, FINAL + ANSWER)
    assert consumed(gpt_oss, forced, ANALYSIS.format(LONG) + HARMONY_CALL)[0] == 3 + 8
    unbudgeted = constraint(gpt_oss, schema=None, tools=[WEATHER], choice="required")
    assert not admits(gpt_oss, unbudgeted, ANALYSIS.format(SHORT) + HARMONY_CALL)


def test_free_text_with_tools_and_a_budget_keeps_both_replies(gpt_oss: Preparer) -> None:
    grammar = constraint(gpt_oss, schema=None, tools=[WEATHER], budget=8)
    assert admits(gpt_oss, grammar, ANALYSIS.format(SHORT) + FINAL + "Sunny.")
    assert admits(gpt_oss, grammar, ANALYSIS.format(SHORT) + HARMONY_CALL)
    assert constraint(gpt_oss, schema=None, tools=[WEATHER]) is None  # no budget: free
