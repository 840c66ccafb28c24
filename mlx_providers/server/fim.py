"""Fill-in-the-middle prompts: a prefix and a suffix laid out in a code model's own markers.

A model trained to fill in the middle (FIM) writes the text between a prefix and a suffix
when they reach it between its marker tokens, in the order it was trained on. Nothing in a
checkpoint says whether it was, so the markers are read from the tokenizer's vocabulary:
a tokenizer holding a family's three markers (or Codestral's two) gets that family's
layout, and one holding none cannot take a ``suffix`` (the door refuses it, naming why).

The prompt is built as token ids, not as text with the markers spelled in it: CodeLlama's
markers (``▁<PRE>``) cannot be written as text its tokenizer would read back as them, and
ids leave no doubt about where the client's text ends. It starts with the tokens the
tokenizer puts before any text (a BOS), as the engine's own text prompts do. A family's
end-of-middle marker (CodeLlama's ``▁<EOT>``) is a stop token: it is not the model's EOS.
Pure: the tokenizer is any object with ``get_vocab`` and ``encode`` (Hugging Face's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class FimTokenizer(Protocol):
    """What is read of a tokenizer: its vocabulary (added tokens included) and encoding."""

    def get_vocab(self) -> Mapping[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...


@dataclass(frozen=True)
class FimLayout:
    """One family's FIM markers, by the spellings its tokenizers give them (the first found
    wins), and how the prompt is laid out."""

    name: str  # who is trained on it (errors and docs name it)
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...] = ()  # empty: the model starts the middle after the prefix
    suffix_first: bool = False  # Codestral: [SUFFIX] suffix [PREFIX] prefix
    # Markers that end the middle, where the vocabulary has them (its EOS may differ).
    ends: tuple[str, ...] = ()
    # SentencePiece prepends a space to encoded text; the suffix follows a marker directly
    # in CodeLlama's training layout, so it is encoded without that space.
    no_leading_space_suffix: bool = False


def _ds(word: str) -> str:
    """A DeepSeek-Coder marker, ``fim▁begin`` between fullwidth bars (escaped: in source
    they are look-alikes of ``|``)."""
    return f"<\uff5cfim\u2581{word}\uff5c>"


# In the order they are tried: no tokenizer known here holds two families' markers.
LAYOUTS = (
    FimLayout("Qwen2.5-Coder / CodeGemma", ("<|fim_prefix|>",), ("<|fim_suffix|>",),
              ("<|fim_middle|>",), ends=("<|endoftext|>", "<|file_separator|>")),
    FimLayout("StarCoder", ("<fim_prefix>",), ("<fim_suffix>",), ("<fim_middle>",),
              ends=("<|endoftext|>", "<file_sep>")),
    FimLayout("CodeLlama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"),
              ends=("▁<EOT>", "<EOT>"), no_leading_space_suffix=True),
    FimLayout("DeepSeek-Coder", (_ds("begin"),), (_ds("hole"),), (_ds("end"),),
              ends=("<|EOT|>",)),
    FimLayout("Codestral", ("[PREFIX]",), ("[SUFFIX]",), suffix_first=True),
)

# The refusal's examples: what a tokenizer that can fill in the middle holds.
KNOWN = ("Qwen2.5-Coder's <|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>, StarCoder's "
         "<fim_prefix>/<fim_suffix>/<fim_middle>, CodeLlama's ▁<PRE>/▁<SUF>/▁<MID>, "
         f"DeepSeek-Coder's {_ds('begin')}/{_ds('hole')}/{_ds('end')}, Codestral's "
         "[PREFIX]/[SUFFIX]")


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM marker ids, in its family's layout."""

    layout: FimLayout
    prefix_id: int
    suffix_id: int
    middle_id: int | None
    end_ids: tuple[int, ...]  # stop tokens for the middle (those the vocabulary has)


def _found(vocab: Mapping[str, int], spellings: Sequence[str]) -> int | None:
    return next((vocab[s] for s in spellings if s in vocab), None)


def fim_tokens(vocab: Mapping[str, int]) -> FimTokens | None:
    """The first layout whose markers are all in ``vocab`` (token -> id); None if none."""
    for layout in LAYOUTS:
        prefix, suffix = _found(vocab, layout.prefix), _found(vocab, layout.suffix)
        middle = _found(vocab, layout.middle) if layout.middle else None
        if prefix is None or suffix is None or (layout.middle and middle is None):
            continue
        ends = tuple(dict.fromkeys(vocab[e] for e in layout.ends if e in vocab))
        return FimTokens(layout, prefix, suffix, middle, ends)
    return None


def special_head(tokenizer: FimTokenizer) -> list[int]:
    """The ids the tokenizer puts before any text it encodes (a BOS, or nothing): what
    encoding with special tokens adds in front of encoding without them."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a"))
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def _without_leading_space(tokenizer: FimTokenizer, text: str) -> list[int]:
    """``text`` encoded as if it followed other text (no SentencePiece space in front):
    encoded behind a newline, whose own tokens are dropped again (Meta's infilling
    encodes behind a marker character the same way)."""
    newline = list(tokenizer.encode("\n", add_special_tokens=False))
    ids = list(tokenizer.encode("\n" + text, add_special_tokens=False))
    if ids[:len(newline)] == newline:
        return ids[len(newline):]
    return list(tokenizer.encode(text, add_special_tokens=False))  # merged: as it is


def fim_prompt(tokenizer: FimTokenizer, tokens: FimTokens, prefix: str | Sequence[int],
               suffix: str) -> list[int]:
    """The prompt ids for the middle between ``prefix`` (text, or token ids taken as they
    are) and ``suffix``, in ``tokens``' layout, after the tokenizer's head (BOS)."""
    layout = tokens.layout
    before = (list(tokenizer.encode(prefix, add_special_tokens=False))
              if isinstance(prefix, str) else list(prefix))
    after = (_without_leading_space(tokenizer, suffix) if layout.no_leading_space_suffix
             else list(tokenizer.encode(suffix, add_special_tokens=False)))
    head = special_head(tokenizer)
    if layout.suffix_first:
        return [*head, tokens.suffix_id, *after, tokens.prefix_id, *before]
    middle = [] if tokens.middle_id is None else [tokens.middle_id]
    return [*head, tokens.prefix_id, *before, tokens.suffix_id, *after, *middle]


class NoFimTokens(ValueError):
    """The tokenizer holds no family's fill-in-the-middle markers."""


def fill_in_the_middle(tokenizer: Any, prefix: str | Sequence[int],
                       suffix: str) -> tuple[list[int], tuple[int, ...]]:
    """The FIM prompt's ids and the stop ids that end the middle; ``NoFimTokens`` when the
    tokenizer has no markers (its message says which it looked for)."""
    tokens = fim_tokens(tokenizer.get_vocab())
    if tokens is None:
        raise NoFimTokens(f"the model's tokenizer has no fill-in-the-middle tokens (such as "
                          f"{KNOWN}), so it cannot complete between a prompt and a suffix")
    return fim_prompt(tokenizer, tokens, prefix, suffix), tokens.end_ids
