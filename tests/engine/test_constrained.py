"""Constrained decoding inside the batch: the grammar, not the model, makes output valid."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jsonschema
import pytest

from engine import Engine, FinishReason, SamplingParams, TextRequest
from engine.errors import InvalidConstraintError
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.inbound.output_constraint import JsonObject, JsonSchema, LarkGrammar, Regex
from tests.conftest import Turns, alone, greedy, prompts_of_lengths, request_for, wait_until

TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "mode": {"enum": ["car", "train", "plane"]},
    },
    "required": ["city", "days", "mode"],
    "additionalProperties": False,
}


def test_schema_rows_validate_beside_unchanged_unconstrained_rows(tiny_engine: Engine) -> None:
    plain = prompts_of_lengths(tiny_engine, [9, 33, 17], seed=41)
    reference = alone(tiny_engine, plain, greedy(40))
    constrained = [tiny_engine.submit(TextRequest(f"trip {i}",
                                                  greedy(80, constraint=JsonSchema(TRIP))))
                   for i in range(3)]
    handles = [tiny_engine.submit(request_for(p, greedy(40))) for p in plain]
    for handle in constrained:
        result = handle.result(timeout=60)
        assert result.finish_reason is FinishReason.STOP, result.text
        jsonschema.validate(json.loads(result.text), TRIP)
    assert [h.result().token_ids for h in handles] == reference
    assert tiny_engine.stats().peak_running >= 4


def test_unconstrained_output_is_not_valid_json_without_the_grammar(tiny_engine: Engine) -> None:
    text = tiny_engine.submit(TextRequest("trip 0", greedy(40))).result().text
    with pytest.raises(ValueError):
        json.loads(text)  # so the previous test's validity comes from the grammar


def test_regex_json_object_and_lark(tiny_engine: Engine) -> None:
    code = greedy(20, constraint=Regex(r"[A-Z]{3}-[0-9]{4}"))
    regex = tiny_engine.submit(TextRequest("code", code)).result()
    assert regex.finish_reason is FinishReason.STOP
    assert len(regex.text) == 8 and regex.text[3] == "-" and regex.text[4:].isdigit()
    obj = tiny_engine.submit(TextRequest("obj", greedy(200, constraint=JsonObject()))).result()
    if obj.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason is FinishReason.LENGTH and obj.text.startswith("{")
    lark = tiny_engine.submit(TextRequest("yes or no", greedy(10, constraint=LarkGrammar(
        'start: ("yes" | "no") "!"')))).result()
    assert lark.text in ("yes!", "no!") and lark.finish_reason is FinishReason.STOP


def test_grammar_completion_stops_before_max_tokens(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(TextRequest("x", greedy(100, constraint=Regex("abc")))).result()
    assert result.text == "abc" and result.finish_reason is FinishReason.STOP
    assert result.usage.completion_tokens < 100


def test_max_tokens_cut_reports_length_not_stop(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(TextRequest("trip",
                                            greedy(5, constraint=JsonSchema(TRIP)))).result()
    assert result.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError):
        json.loads(result.text)


@pytest.mark.parametrize("constraint", [
    Regex("[a-"), JsonSchema({"type": "bogus"}), LarkGrammar("start: undefined_rule"),
])
def test_invalid_constraint_is_rejected_at_submit(tiny_engine: Engine, constraint) -> None:  # type: ignore[no-untyped-def]
    sibling = tiny_engine.submit(TextRequest("fine", greedy(10)))
    with pytest.raises(InvalidConstraintError):
        tiny_engine.submit(TextRequest("bad", greedy(10, constraint=constraint)))
    assert sibling.result().usage.completion_tokens == 10
    assert isinstance(InvalidConstraintError("x"), ValueError)


def test_constrained_rows_on_the_serial_lane(tiny_engine: Engine) -> None:
    params = SamplingParams(max_tokens=80, temperature=0.9, seed=5, constraint=JsonSchema(TRIP))
    first = tiny_engine.submit(TextRequest("trip", params)).result()
    jsonschema.validate(json.loads(first.text), TRIP)
    assert tiny_engine.submit(TextRequest("trip", params)).result().text == first.text


def test_matchers_are_released_on_every_exit_path(make_engine) -> None:  # type: ignore[no-untyped-def]
    turns = Turns()
    eng = make_engine(max_batch=2, probe=turns.probe)
    schema = greedy(60, constraint=JsonSchema(TRIP))
    long_schema = greedy(1000, constraint=Regex("[a-z ]{0,2000}"))

    def live() -> int:  # matchers held once the engine has nothing left to run
        return turns.settled().stats.live_matchers

    # finished
    eng.submit(TextRequest("a", schema)).result()
    assert live() == 0
    # stopped by the callback
    eng.submit(TextRequest("b", long_schema), on_token=lambda *_: False).result()
    assert live() == 0
    # evicted mid-decode, and cancelled while pending (max_batch=2 keeps the third waiting)
    seen: list[int] = []
    running = [eng.submit(TextRequest(f"r{i}", long_schema), on_token=lambda t, _: seen.append(t))
               for i in range(2)]
    pending = eng.submit(TextRequest("p", long_schema))
    wait_until(lambda: len(seen) > 4 and turns.last.stats.running == 2
               and turns.last.stats.pending == 1)
    assert turns.last.stats.live_matchers == 2
    pending.cancel()
    for h in running:
        h.cancel()
    assert all(h.result().finish_reason is FinishReason.CANCELLED for h in [pending, *running])
    assert live() == 0

    # failed (its logits processor raises)
    def explode(tokens, logits):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        eng.submit(TextRequest("f", greedy(20, constraint=Regex("[a-z]+"),
                               logits_processors=(explode,)))).result()
    assert live() == 0
    # engine shutdown with a constrained row in flight
    seen.clear()
    eng.submit(TextRequest("s", long_schema), on_token=lambda t, _: seen.append(t))
    wait_until(lambda: len(seen) > 2 and turns.last.stats.live_matchers == 1)
    eng.close()
    assert eng.stats().live_matchers == 0  # taken after the shutdown released every row


def test_compiled_grammars_are_cached_and_bounded(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    # The compiler the engine builds for its tokenizer, with the default cache size.
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_model_dir), vocab)
    size = inspect.signature(GrammarCompiler).parameters["cache_size"].default
    first = compiler.compile(JsonSchema(TRIP))
    assert compiler.compile(JsonSchema(dict(TRIP))) is first
    others = [compiler.compile(Regex(f"x{i}")) for i in range(size - 1)]  # full now
    assert compiler.compile(Regex("x0")) is others[0]  # kept, and now the newest
    compiler.compile(Regex("one more"))  # past the bound: the least recent goes
    assert compiler.compile(Regex("x0")) is others[0]
    assert compiler.compile(JsonSchema(TRIP)) is not first


def test_a_dead_grammar_fails_its_row_naming_the_constraint(tiny_model_dir: Path) -> None:
    """A matcher no token can continue (llguidance then allows only end-of-sequence, which
    would end the row looking complete) raises, naming the constraint: the row fails
    alone, never ends quietly or goes on unconstrained."""
    import numpy as np
    from transformers import AutoTokenizer

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer, vocab)
    grammar = compiler.row(JsonSchema(TRIP))
    bitmask = np.zeros((1, compiler.words), dtype=np.int32)
    grammar.fill(bitmask, 0)  # a live matcher: its allowed tokens
    assert bitmask.any()
    with pytest.raises(InvalidConstraintError, match="JSON schema"):
        grammar.consume(tokenizer.encode("hello")[0])  # not JSON: refused
    with pytest.raises(InvalidConstraintError, match=r"JSON schema .*no token can continue"):
        grammar.fill(bitmask, 0)
    grammar.close()


def test_a_grammar_with_a_bounded_lexeme_rolls_back_through_a_copy(tiny_model_dir: Path) -> None:
    """A reasoning budget's ``thinking[max_tokens=N]`` lexeme is one llguidance cannot roll
    back; speculation marks a row's grammar, consumes a draft and rolls it back. Found by
    the interaction fuzz (a reasoning budget, a forced call and speculation): the row
    failed with "cannot roll back". Such a grammar's mark now keeps a copy of its matcher."""
    import numpy as np
    from transformers import AutoTokenizer

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer, vocab)
    budget = LarkGrammar('start: thinking "</think>" answer\nthinking[max_tokens=4]: /(?s:.*)/\n'
                         'answer: "yes" | "no"')
    grammar, twin = compiler.row(budget), compiler.row(budget)
    words = tokenizer.encode(" hello there", add_special_tokens=False)
    grammar.consume(words[0])
    twin.consume(words[0])
    mark = grammar.mark()
    for token in words[1:]:  # a draft, consumed to fill its masks
        grammar.consume(token)
    grammar.rollback(mark)
    for state in (grammar, twin):  # both where they were: the same mask next
        state.consume(words[1])
    masks = [np.zeros((1, compiler.words), dtype=np.int32) for _ in range(2)]
    grammar.fill(masks[0], 0)
    twin.fill(masks[1], 0)
    assert (masks[0] == masks[1]).all()
    grammar.close()
    twin.close()
    assert compiler.live_matchers == 0
