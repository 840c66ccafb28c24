"""The dialect machinery on the tiny model's real tokenizer: which dialect it speaks, how a
text with special tokens becomes Lark, and the forced-call grammar assembled around it."""

from __future__ import annotations

from engine import Engine, LarkGrammar
from engine.requests.constraints.forced_calls import forced_grammar
from engine.requests.constraints.grammar import GrammarCompiler
from engine.requests.dialects.dialect import Dialect, TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.channels import TOOL
from tests.unit.test_tools import WEATHER


def compiler_of(eng: Engine) -> GrammarCompiler:
    return GrammarCompiler(eng.tokenizer._tokenizer, len(eng.tokenizer.vocab))


def test_special_tokens_inside_a_text_become_tokens_in_lark(tiny_engine: Engine) -> None:
    compiler = compiler_of(tiny_engine)
    end = tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert compiler.lark_text("ok<|im_end|>\nnext") == f'"ok" <[{end}]> "\\nnext"'
    call = tiny_engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    assert compiler.lark_text("<tool_call>") == f"<[{call}]>"  # an added token is one too
    assert compiler.lark_text("") == '""'


def test_the_tiny_model_speaks_the_default_dialect(tiny_engine: Engine) -> None:
    dialect = dialect_for(TokenizerFacts.of(tiny_engine.tokenizer))
    assert type(dialect) is Dialect
    assert dialect.markers[TOOL] == ("<tool_call>", "</tool_call>")
    assert dialect.parser is None  # json_tools: its calls are JSON objects, read as they stream


def test_a_forced_grammar_may_close_the_reasoning_first(tiny_engine: Engine) -> None:
    compiler = compiler_of(tiny_engine)
    dialect = dialect_for(TokenizerFacts.of(tiny_engine.tokenizer))
    tools = normalize_tools([WEATHER])
    calls = dialect.forced_calls(tools, "required", False, compiler.lark_text)
    grammar = forced_grammar(calls, f'{compiler.lark_text("</think>")} "\\n\\n"').grammar
    matcher = compiler.compile(LarkGrammar(grammar)).deep_copy()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tiny_engine.tokenizer.encode("</think>\n\n" + call, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids), matcher.get_error()
    fresh = compiler.compile(LarkGrammar(grammar)).deep_copy()
    direct = tiny_engine.tokenizer.encode(call, add_special_tokens=False)
    assert fresh.try_consume_tokens(direct) < len(direct)  # the close comes first
