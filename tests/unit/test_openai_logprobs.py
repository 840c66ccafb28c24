"""engine.openai_logprobs: the one conversion of the engine's TokenLogprob values into
OpenAI's ``logprobs`` object, which the server and both faces use (no model)."""

from __future__ import annotations

from engine import TokenLogprob, openai_logprobs, token_texts

TEXTS = {1: " Paris", 2: "é", 3: "\ufffd"}


class Tokenizer:
    """Decodes one known id at a time, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return TEXTS[ids[0]]


def test_each_token_becomes_an_openai_entry_with_its_alternatives_in_order() -> None:
    tokens = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.25))), TokenLogprob(2, -2.0)]
    out = openai_logprobs(tokens, token_texts(Tokenizer()))
    assert out == {"content": [
        {"token": " Paris", "logprob": -0.5, "bytes": [32, 80, 97, 114, 105, 115],
         "top_logprobs": [
             {"token": " Paris", "logprob": -0.5, "bytes": [32, 80, 97, 114, 105, 115]},
             {"token": "é", "logprob": -1.25, "bytes": [195, 169]}]},
        {"token": "é", "logprob": -2.0, "bytes": [195, 169], "top_logprobs": []}],
        "refusal": None}


def test_none_asked_is_none_and_none_generated_is_an_empty_list() -> None:
    texts = token_texts(Tokenizer())
    assert openai_logprobs(None, texts) is None
    assert openai_logprobs((), texts) == {"content": [], "refusal": None}


def test_a_tokens_text_is_decoded_once() -> None:
    tokenizer = Tokenizer()
    texts = token_texts(tokenizer)
    openai_logprobs([TokenLogprob(1, -0.5, ((1, -0.5), (3, -3.0)))] * 10, texts)
    assert tokenizer.calls == 2
