"""What each family's tokenizer is checked against: an independent tokenization.

llama.cpp's own test vectors (``.inp`` texts, ``.out`` ids) for the vocabularies that come
from its GGUF files; tiktoken itself, on the same ranks and split, for o200k_base,
cl100k_base and Tekken (whose ids sit after Mistral's 1,000 control tokens), over every
text of llama.cpp's vectors.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from testkit.families import assets, vocabularies
from testkit.families.catalog import Family

# The vector files whose texts test the tiktoken-based vocabularies (many scripts, emoji,
# whitespace runs, code).
_TEXT_SOURCES = ("qwen2", "llama-bpe", "gemma-4", "phi-3", "command-r", "deepseek-llm",
                 "starcoder", "gpt-2")


def _texts() -> list[str]:
    texts: list[str] = []
    for name in _TEXT_SOURCES:
        texts += [text for text, _ in vocabularies.reference_vectors(assets.vocab_file(name))]
    return list(dict.fromkeys(texts))


def _tiktoken_reference(ranks: dict[bytes, int], split: str, offset: int,
                        name: str) -> list[tuple[str, list[int]]]:
    import tiktoken

    encoding = tiktoken.Encoding(name, pat_str=split, mergeable_ranks=ranks, special_tokens={})
    return [(text, [i + offset for i in encoding.encode_ordinary(text)]) for text in _texts()]


def reference_ids(family: Family) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs the family's tokenizer must reproduce."""
    vocabulary = family.vocabulary
    if vocabulary.kind == "gguf":
        name = vocabulary.vectors or vocabulary.name
        return vocabularies.reference_vectors(assets.vocab_file(name))
    if vocabulary.kind == "tiktoken":
        ranks = vocabularies.tiktoken_ranks(assets.tiktoken_file(vocabulary.name))
        split = (vocabularies.O200K_SPLIT if vocabulary.name == "o200k"
                 else vocabularies.CL100K_SPLIT)
        return _tiktoken_reference(ranks, split, 0, vocabulary.name)
    ranks, split, specials = vocabularies.tekken_ranks(
        assets.tekken_dir() / f"{vocabulary.name}.json", family.vocab_size)
    return _tiktoken_reference(ranks, split, specials, vocabulary.name)


def match_rate(family: Family, tokenizer: Tokenizer) -> tuple[int, int]:
    """(texts tokenized exactly as the reference, texts checked)."""
    return vocabularies.match_rate(tokenizer, reference_ids(family))
