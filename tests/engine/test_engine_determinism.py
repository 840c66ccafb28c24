"""Batched greedy tokens equal each request run alone: the core correctness check."""

from __future__ import annotations

import random

from engine import Engine, FinishReason
from tests.conftest import alone, greedy, prompts_of_lengths, request_for, wait_until


def test_batched_equals_alone_for_mixed_prompt_lengths(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [3, 17, 64, 65, 130, 7, 250, 41])
    params = greedy(32)
    reference = alone(tiny_engine, prompts, params)
    assert len(set(reference)) == len(prompts), "prompts should give distinct continuations"
    handles = [tiny_engine.submit(request_for(p, params)) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == reference
    assert tiny_engine.stats().peak_running >= 6


def test_needle_at_a_random_batch_position(tiny_engine: Engine) -> None:
    rng = random.Random(1234)
    hay = prompts_of_lengths(tiny_engine, [rng.randrange(5, 120) for _ in range(11)], seed=5)
    needle = prompts_of_lengths(tiny_engine, [77], seed=99)[0]
    params = greedy(28)
    expected = alone(tiny_engine, [needle], params)[0]
    position = rng.randrange(len(hay) + 1)
    batch = [*hay[:position], needle, *hay[position:]]
    handles = [tiny_engine.submit(request_for(p, params)) for p in batch]
    results = [h.result(timeout=60).token_ids for h in handles]
    assert results[position] == expected


def test_rows_joining_mid_decode_do_not_change_anyone(tiny_engine: Engine) -> None:
    prompts = prompts_of_lengths(tiny_engine, [20, 90, 33, 150, 12, 60], seed=3)
    params = greedy(40)
    reference = alone(tiny_engine, prompts, params)
    handles = []
    for p in prompts:
        counted: list[int] = []
        handle = tiny_engine.submit(request_for(p, params), on_token=lambda t, _,
                                    c=counted: c.append(t))
        handles.append(handle)
        # Let the rows so far decode a few tokens before the next one joins.
        wait_until(lambda c=counted, h=handle: len(c) >= 3 or h.done)
    assert [h.result(timeout=60).token_ids for h in handles] == reference


def test_long_prompt_prefilled_in_chunks_matches_one_shot(make_engine) -> None:  # type: ignore[no-untyped-def]
    chunked = make_engine(max_batch=8, prefill_chunk=16)
    whole = make_engine(max_batch=8, prefill_chunk=4096)
    prompt = prompts_of_lengths(chunked, [700], seed=11)[0]
    params = greedy(24)
    request = request_for(prompt, params)
    assert chunked.submit(request).result().token_ids == whole.submit(request).result().token_ids


def test_decoding_rows_keep_going_while_a_long_prompt_prefills(make_engine) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_batch=8, prefill_chunk=16)
    short, long_prompt = prompts_of_lengths(eng, [8, 1200], seed=2)
    params = greedy(60)
    reference = alone(eng, [short], params)[0]
    tokens_at_long_first_token: list[int] = []
    short_tokens: list[int] = []
    decoding = eng.submit(request_for(short, params), on_token=lambda t,
                          _: short_tokens.append(t) or None)
    wait_until(lambda: len(short_tokens) >= 1)
    long_handle = eng.submit(request_for(long_prompt, greedy(2)), on_token=lambda t, _: (
        tokens_at_long_first_token.append(len(short_tokens)) or None))
    assert decoding.result().token_ids == reference
    long_handle.result()
    # 1200 tokens in 16-token chunks take ~75 steps; the short row decoded during them.
    assert tokens_at_long_first_token[0] >= 30


def test_chat_messages_use_the_chat_template(tiny_engine: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tiny_engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    by_messages = tiny_engine.submit(request_for(messages, greedy(12))).result()
    by_ids = tiny_engine.submit(request_for(tiny_engine.tokenizer.encode(text),
                                            greedy(12))).result()
    assert by_messages.token_ids == by_ids.token_ids
    assert by_messages.usage.prompt_tokens == len(tiny_engine.tokenizer.encode(text))
    assert by_messages.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
