"""Per-row text with the tiny model's real tokenizer: multibyte characters stream whole."""

from __future__ import annotations

from pathlib import Path

from engine.requests.outbound.text import RowText


def test_multibyte_characters_with_a_real_tokenizer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    text = "naïve café — 日本語 🎉 done"
    ids = tokenizer.encode(text)
    row = RowText(tokenizer.detokenizer, ())
    deltas = [row.add_token(t) for t in ids]
    deltas.append(row.finish())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # no half characters streamed


def test_a_space_that_starts_the_output_streams_as_the_decode_keeps_it(
        tiny_model_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    # mlx-lm's byte-level detokenizer trims it ("Hello"), a lone space too (nothing).
    for text in (" Hello world", "  two spaces", " "):
        ids = tokenizer.encode(text, add_special_tokens=False)
        row = RowText(tokenizer.detokenizer, (), tokenizer.decode)
        deltas = [row.add_token(t) for t in ids]
        deltas.append(row.finish())
        assert "".join(deltas) == row.text == tokenizer.decode(ids) == text
