"""Every family on its real tokenizer and template: ids, template, inference, exact decode.

For each family of ``testkit.families``: its tokenizer reproduces an independent reference
tokenization (llama.cpp's vectors, or tiktoken on the same ranks); its published template
renders tools, a tool-call turn and a tool result, or fails in the way the catalog records;
mlx-lm infers the tool parser and thinking markers it infers for the real checkpoint (as the
catalog records them); and its tiny model of the real architecture loads through the engine,
batched greedy equal to alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from engine import ChatRequest, Engine, TextRequest, TokenLogprob, openai_logprobs, token_texts
from testkit.families import Family
from testkit.families.references import match_rate
from testkit.families.transcripts import QUESTION, WEATHER_TOOL, tool_call_message
from testkit.forcing import forcing
from tests.conftest import greedy


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(
        tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, **kwargs)
    )


def _renders(tokenizer: Any) -> dict[str, str]:
    """What the template did with tools, a call and a result: rendered/dropped/raises."""
    question = [{"role": "user", "content": QUESTION}]
    result = {
        "role": "tool",
        "tool_call_id": "a1b2c3d4e",
        "name": "get_weather",
        "content": "22 degrees and sunny",
    }
    found: dict[str, str] = {}
    checks = {
        "tools": (question, {"add_generation_prompt": True}, "get_weather"),
        "xml_tools": (question, {"add_generation_prompt": True, "xml_tools": [WEATHER_TOOL]},
                      "get_weather"),
        "call": ([*question, tool_call_message()], {}, "Paris"),
        "result": (
            [*question, tool_call_message(), result],
            {"add_generation_prompt": True},
            "22 degrees and sunny",
        ),
    }
    for what, (messages, kwargs, needle) in checks.items():
        try:
            text = _render(tokenizer, messages, **kwargs)
        except Exception:  # a template that refuses the history (raise_exception)
            found[what] = "raises"
            continue
        tail = text.split(QUESTION, 1)[-1] if what not in ("tools", "xml_tools") else text
        found[what] = "rendered" if needle in tail else "dropped"
    return found


def test_tokenizer_ids_equal_the_reference(family: Family, family_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(family_dir / "tokenizer.json"))
    same, total = match_rate(family, tokenizer)
    assert total == family.expected.reference_texts >= 40, (
        f"{family.name}: {total} reference texts, the catalog says "
        f"{family.expected.reference_texts}")
    assert same == total, f"{family.name}: {same}/{total} texts tokenized as the reference"


def test_the_engine_tokenizer_places_the_family_tokens(
    family: Family, family_engine: Engine
) -> None:
    tokenizer = family_engine.tokenizer
    for token_id, token in family.added.items():
        if token.content.startswith(("<SPECIAL_", "<|reserved_", "<unused_slot_")):
            continue
        assert tokenizer.encode(token.content, add_special_tokens=False) == [token_id], (
            f"{family.name}: {token.content!r} is not the single token {token_id}"
        )
    eos = {tokenizer.convert_tokens_to_ids(t) for t in family.eos}
    assert eos <= set(tokenizer.eos_token_ids)


def test_mlx_lm_infers_what_it_infers_for_the_real_checkpoint(
    family: Family, family_engine: Engine
) -> None:
    tokenizer = family_engine.tokenizer
    parser = tokenizer._tokenizer.init_kwargs.get("tool_parser_type")
    think = tokenizer.think_start if tokenizer.has_thinking else None
    assert (parser, think) == (family.expected.tool_parser, family.expected.think_start)


def test_the_template_renders_a_tool_round_trip_or_fails_as_recorded(
    family: Family, family_engine: Engine
) -> None:
    expected = {"tools": "rendered", "call": "rendered", "result": "rendered"}
    expected.update(
        {what: how.split(" ")[0] for what, how in family.expected.cannot_render.items()}
    )
    expected.setdefault("xml_tools", expected["tools"])  # as tools= unless recorded
    assert _renders(family_engine.tokenizer) == expected


def test_the_family_loads_and_batched_greedy_equals_alone(
    family: Family, family_engine: Engine
) -> None:
    questions = [
        "What is the weather in Paris?",
        "Hi",
        "Name three colours.",
        "Write a haiku about the sea, please, in English.",
    ]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = greedy(8)
    alone = [
        family_engine.submit(ChatRequest.from_openai(chat, params)).result(timeout=120).token_ids
        for chat in chats
    ]
    assert all(alone), f"{family.name}: a chat decoded nothing"
    handles = [family_engine.submit(ChatRequest.from_openai(chat, params)) for chat in chats]
    assert [h.result(timeout=120).token_ids for h in handles] == alone
    assert family_engine.stats().batch_mode in ("batch", "serial")


def test_the_vocabulary_is_the_models_logits_width(family: Family, family_engine: Engine) -> None:
    # Read from the logits, wherever the config keeps vocab_size (text_config wrappers).
    last = family.vocab_size - 1
    assert family_engine.submit(TextRequest([1, 2, last], greedy(2))).result(timeout=60).token_ids
    with pytest.raises(ValueError, match="out of range"):
        family_engine.submit(TextRequest([1, 2, family.vocab_size], greedy(2))).result(timeout=60)


def test_the_streamed_text_is_the_decode_of_the_reply(family: Family,
                                                      family_engine: Engine) -> None:
    # A reply whose first token starts with a space (gpt-oss's " to=functions..." right
    # after <|start|>assistant) keeps it, as the tokenizer's decode does; multi-byte
    # characters split across tokens stream whole.
    tokenizer = family_engine.tokenizer
    ids = tokenizer.encode(" Hello wörld 🎉 日本", add_special_tokens=False)
    request = ChatRequest.from_openai([{"role": "user", "content": "Hi"}],
                                      greedy(len(ids), logits_processors=(forcing(ids),)))
    handle = family_engine.submit(request)
    streamed = "".join(event.text for event in handle)
    result = handle.result(timeout=60)
    assert list(result.token_ids) == ids
    assert streamed == result.text == tokenizer.decode(ids)


def test_logprob_bytes_are_each_tokens_own_and_add_up_to_the_text(
        family: Family, family_engine: Engine) -> None:
    # A rare character and an emoji split over byte tokens ("<0xF0>"... in sentencepiece,
    # pieces of byte-level BPE's alphabet): each token's entry has its own bytes.
    tokenizer = family_engine.tokenizer
    text = "x 𠮷 🎉 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = openai_logprobs([TokenLogprob(i, -1.0) for i in ids], token_texts(tokenizer))
    assert entries is not None
    whole = b"".join(bytes(entry["bytes"]) for entry in entries["content"]).decode("utf-8")
    # Sentencepiece starts the first word with its "▁", a space (its decoder may strip it).
    first = tokenizer.convert_ids_to_tokens(ids[0])
    assert whole == (" " if first.startswith("\u2581") else "") + text
