"""Logprobs' ``bytes`` with the tiny model's real (byte-level BPE) tokenizer: each token's
own bytes, so a character split over tokens adds up whole (OpenAI's contract)."""

from __future__ import annotations

from pathlib import Path

from engine import TokenLogprob, openai_logprobs, token_texts

TEXT = "naïve 🎉 日本語 <|im_end|>"


def test_a_character_split_over_tokens_adds_up_from_their_bytes(tiny_model_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Each token chosen, the next one its alternative: alternatives carry bytes too.
    following = ids[1:] + ids[:1]
    tokens = [TokenLogprob(i, -1.0, ((j, -2.0),)) for i, j in zip(ids, following)]
    entries = openai_logprobs(tokens, token_texts(tokenizer))
    assert entries is not None
    content = entries["content"]
    halves = [entry for entry in content if "\ufffd" in entry["token"]]
    assert halves, "no character of the text is split over tokens: nothing is checked"
    assert all(bytes(entry["bytes"]) != "\ufffd".encode() for entry in halves)
    assert b"".join(bytes(entry["bytes"]) for entry in content) == TEXT.encode()
    by_id = {token.token_id: entry["bytes"] for token, entry in zip(tokens, content)}
    assert [entry["top_logprobs"][0]["bytes"] for entry in content] == [
        by_id[j] for j in following]
    for entry in content:  # a token's text is its bytes read alone (a half is U+FFFD)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
