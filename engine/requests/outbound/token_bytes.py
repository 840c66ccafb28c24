"""A token's own bytes, read from its tokenizer's vocabulary (OpenAI's logprobs ``bytes``).

A token may hold part of a multi-byte character (an emoji or a CJK character split over
two tokens): decoded alone it reads U+FFFD, whose bytes are not the token's. Its bytes are
in its vocabulary entry instead. Byte-level BPE (GPT-2, Llama 3, Qwen, gpt-oss, Tekken)
spells each byte as one printable character (GPT-2's ``bytes_to_unicode``); sentencepiece
spells a space as "▁" and a byte it has no piece for as ``<0xNN>``. Added tokens
(``<|im_end|>``) are their content as written. The bytes of consecutive tokens add up to
the UTF-8 of their text. No mlx here; the tokenizer is Hugging Face's (or mlx-lm's wrapper
of it), read through its public methods.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

TokenBytes = Callable[[int], "bytes | None"]  # token id -> its bytes, None when unknown

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_PIECE = "\u2581"  # sentencepiece's "▁"


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` reversed: the printable character of each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in chars.items()}


def _decoder_kind(tokenizer: Any) -> str:
    """``byte-level``, ``sentencepiece`` or "" (a vocabulary this module cannot read),
    from the decoder of the tokenizer's ``tokenizers`` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return ""
    try:
        spec = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return ""
    parts = (spec.get("decoders") or [spec]) if isinstance(spec, dict) else []
    kinds = {part.get("type") for part in parts if isinstance(part, dict)}
    if "ByteLevel" in kinds:
        return "byte-level"
    spaces = [part for part in parts if isinstance(part, dict) and (
        part.get("type") == "Metaspace"
        or (part.get("type") == "Replace"
            and (part.get("pattern") or {}).get("String") == _SPACE_PIECE))]
    return "sentencepiece" if spaces else ""


def _byte_level(piece: str) -> bytes:
    """A byte-level BPE piece's bytes (a character outside its alphabet as its UTF-8)."""
    table = _byte_of_char()
    out = bytearray()
    for char in piece:
        byte = table.get(char)
        out.extend(bytes([byte]) if byte is not None else char.encode())
    return bytes(out)


def _sentencepiece(piece: str) -> bytes:
    """A sentencepiece piece's bytes: ``<0xNN>`` is byte NN, "▁" a space."""
    byte = _BYTE_TOKEN.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPACE_PIECE, " ").encode()


def token_bytes(tokenizer: Any) -> TokenBytes:
    """``token id -> its bytes`` for ``tokenizer`` (mlx-lm's wrapper or Hugging Face's);
    None for every id where its vocabulary is neither byte-level BPE nor sentencepiece,
    and for an id it has no token at (a model's padded vocabulary)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    kind = _decoder_kind(hf)
    if not kind:
        return lambda token_id: None
    added = {token_id: str(getattr(token, "content", token))
             for token_id, token in (getattr(hf, "added_tokens_decoder", None) or {}).items()}
    spell = _byte_level if kind == "byte-level" else _sentencepiece

    def of(token_id: int) -> bytes | None:
        if token_id in added:  # matched whole, kept as written: never byte-spelled
            return added[token_id].encode()
        piece = hf.convert_ids_to_tokens(token_id)
        return spell(piece) if isinstance(piece, str) else None

    return of
