"""Real vocabularies as Hugging Face ``tokenizers`` objects, from the files PyPI ships.

Three sources: llama.cpp's vocab-only GGUFs (converted with transformers' own GGUF tokenizer
builders, which pick the pre-tokenizer split each ``tokenizer.ggml.pre`` names), tiktoken
rank files (o200k_base, cl100k_base) and Mistral's Tekken JSON (byte-level BPE whose merges
are implied by the ranks, rebuilt here). A family then places its own added tokens at the
ids its published tokenizer gives them (``with_added_tokens``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# tiktoken's o200k_base split (GPT-4o), and cl100k_base's.
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp pre-tokenizer names of vocabularies converted from tiktoken ranks.
_TIKTOKEN_DERIVED = frozenset({"llama-bpe", "llama3", "llama-v3"})


@dataclass(frozen=True)
class AddedToken:
    """A token placed at a fixed id: special (control) or a plain added token."""

    content: str
    special: bool = True


# --- llama.cpp vocab GGUFs ----------------------------------------------------------------------


def gguf_tokenizer_dict(path: Path) -> tuple[str, dict[str, Any]]:
    """``(architecture, tokenizer_dict)`` in the shape transformers' GGUF builders take."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    from engine.models.gguf import read_header

    header = read_header(path)
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    found = {name: header.metadata[f"tokenizer.{key}"] for key, name in renames.items()
             if f"tokenizer.{key}" in header.metadata}
    return header.architecture, found


def from_gguf(path: Path) -> Tokenizer:
    """The tokenizer a vocab-only GGUF describes, built by transformers' GGUF converter."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    architecture, tokenizer_dict = gguf_tokenizer_dict(path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    spec = json.loads(backend.to_str())
    # transformers' GPT-2 class adds its default <|endoftext|> past the file's vocabulary.
    size = len(tokenizer_dict["tokens"])
    spec["added_tokens"] = [entry for entry in spec.get("added_tokens") or []
                            if entry["id"] < size]
    if tokenizer_dict.get("pre_tokenizer_type") in _TIKTOKEN_DERIVED:
        # Meta's tokenizer.json looks a whole split piece up before merging (tiktoken's
        # rule): " Việt" is one token there, four pieces by merges alone.
        spec["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def reference_vectors(path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors for a vocab GGUF: each ``.inp`` text with its ``.out`` ids."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in ids.split()]) for text, ids in zip(texts, lines)]


# --- byte-level BPE from ranks (tiktoken, Tekken) -------------------------------------------------


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet byte-level BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _merges(ranks: Mapping[bytes, int]) -> Iterator[tuple[bytes, bytes]]:
    """Every merge that makes each multi-byte token, in the token's rank order.

    A rank-based BPE merges the lowest-ranked adjacent pair first, so which two halves a
    token is finally made from depends on the text around it: every split whose halves
    both rank lower is a merge BPE may need, with the token's rank as its priority.
    """
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
        yield from sorted(splits, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))


def from_ranks(ranks: Mapping[bytes, int], split: str, offset: int = 0) -> Tokenizer:
    """A byte-level BPE over ``ranks`` (token id = rank + ``offset``), tiktoken-equivalent:
    each split piece that is a whole token is taken as is (``ignore_merges``)."""
    spelling = _byte_spelling()

    def spelled(token: bytes) -> str:
        return "".join(spelling[b] for b in token)

    vocab = {spelled(token): rank + offset for token, rank in ranks.items()}
    merges = [(spelled(left), spelled(right)) for left, right in _merges(ranks)]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one ``base64-token rank`` pair a line."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tekken_ranks(path: Path, vocab_size: int) -> tuple[dict[bytes, int], str, int]:
    """``(ranks, split regex, special-token count)`` of a Tekken file, cut to the ranks a
    ``vocab_size`` model uses (Mistral's checkpoints keep the first ones)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    config = data["config"]
    specials = int(config["default_num_special_tokens"])
    kept = vocab_size - specials
    ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"])
             for entry in data["vocab"][:kept]}
    return ranks, str(config["pattern"]), specials


# --- a family's own added tokens ------------------------------------------------------------------


def with_added_tokens(tokenizer: Tokenizer, placed: Mapping[int, AddedToken]) -> Tokenizer:
    """``tokenizer`` with each of ``placed`` matched whole as the id given, whatever the
    vocabulary held there (llama.cpp's ``[PAD151657]`` placeholders, reserved tokens)."""
    spec = json.loads(tokenizer.to_str())
    ids = set(placed)
    spec["added_tokens"] = [entry for entry in spec.get("added_tokens") or []
                            if entry["id"] not in ids]
    contents = {token.content for token in placed.values()}
    spec["added_tokens"] = [entry for entry in spec["added_tokens"]
                            if entry["content"] not in contents]
    for token_id, token in sorted(placed.items()):
        spec["added_tokens"].append({
            "id": token_id, "content": token.content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": token.special,
        })
    vocab = spec["model"].get("vocab")
    if isinstance(vocab, dict):  # BPE: the id now belongs to the added token alone
        clashes = [k for k, v in vocab.items() if k in contents and v not in ids]
        if clashes:  # the same text at two ids: encoding would pick one arbitrarily
            raise ValueError(f"added tokens already in the vocabulary elsewhere: {clashes[:5]}")
        for key in [k for k, v in vocab.items() if v in ids]:
            del vocab[key]
        for token_id, token in placed.items():
            vocab[token.content] = token_id
    spec["added_tokens"].sort(key=lambda entry: entry["id"])
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def match_rate(tokenizer: Tokenizer, vectors: list[tuple[str, list[int]]]) -> tuple[int, int]:
    """How many of llama.cpp's reference texts encode to exactly their ids."""
    same = sum(tokenizer.encode(text, add_special_tokens=False).ids == ids
               for text, ids in vectors)
    return same, len(vectors)
