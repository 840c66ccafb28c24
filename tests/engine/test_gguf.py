"""engine.models.gguf: GGUF header parsing, weight mapping, tokenizer rebuild and clear refusals.

Tiny GGUFs are written here with the ``gguf`` package (llama.cpp's own writer), from weights
in Hugging Face layout put through llama.cpp's q/k row permutation, so the converter is
checked against an independent encoder rather than against itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import UnsupportedModelError
from engine.models.gguf import (
    FloatDtype,
    check_supported,
    convert_gguf,
    read_header,
    write_tokenizer,
)

gguf = pytest.importorskip("gguf", reason="the gguf package (dev dependency) writes test files")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "1 2"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Special tokens, the 256 byte-level characters, then one token per merge."""
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (what the converter must undo)."""
    split = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(w.shape))


def hf_weights(seed: int = 0, *, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny llama, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    head_dim = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": mat(vocab, HIDDEN),
        "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
    }
    if not tied:
        weights["lm_head.weight"] = mat(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": mat(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.up_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.down_proj.weight": mat(HIDDEN, FFN),
            p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
                np.float32
            ),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    return weights


_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module = hf_name.removesuffix(".weight")
    if module in top:
        return top[module] + ".weight"
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{_TO_GGUF[rest]}.weight"


def write_tiny_llama_gguf(
    path: Path,
    *,
    tensor_type: str = "F32",
    weights: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    add_bos: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny llama GGUF; matrices stored as ``tensor_type``, norms as F32."""
    weights = hf_weights() if weights is None else weights
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in weights.items():
        if name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored_values(value: np.ndarray, tensor_type: str) -> np.ndarray:
    """What a GGUF of ``tensor_type`` holds for ``value``, per gguf's reference dequantizer.

    Quantization acts within rows, so it commutes with the q/k row permutation.
    """
    if value.ndim == 1 or tensor_type == "F32":
        return value
    if tensor_type == "F16":
        return value.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    restored = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
    return np.asarray(restored, dtype=np.float32)


def load_safetensors(directory: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    loaded = mx.load(str(directory / "model.safetensors"))
    assert isinstance(loaded, dict)
    return {k: np.array(v.astype(mx.float32)) for k, v in loaded.items()}


# --- header -------------------------------------------------------------------------------------


def test_read_header_gives_plain_metadata_and_row_major_shapes(tmp_path: Path) -> None:
    header = read_header(write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q4_1"))
    assert header.version == 3
    assert header.architecture == "llama"
    assert header.arch_value("block_count") == LAYERS
    assert header.metadata["tokenizer.ggml.tokens"][:3] == SPECIALS
    assert header.metadata["tokenizer.ggml.merges"] == MERGES
    assert header.metadata["tokenizer.ggml.add_bos_token"] is False
    tensors = {t.name: t for t in header.tensors}
    assert tensors["blk.0.ffn_down.weight"].shape == (HIDDEN, FFN)
    assert tensors["blk.0.ffn_down.weight"].ggml_type == "Q4_1"
    assert tensors["output_norm.weight"].ggml_type == "F32"


def test_not_a_gguf_is_a_clear_value_error(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_header(bogus)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(write_tiny_llama_gguf(tmp_path / "m.gguf").read_bytes()[:2000])
    with pytest.raises(ValueError, match="truncated"):
        read_header(truncated)


# --- weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"])
def test_dequantized_weights_match_the_reference_dequantizer(
    tmp_path: Path, tensor_type: str
) -> None:
    weights = hf_weights()
    src = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, weights=weights)
    out = convert_gguf(src, tmp_path / "out", quantized=False)
    converted = load_safetensors(out)
    assert set(converted) == set(weights)
    for name, value in weights.items():
        expected = stored_values(value, tensor_type)
        np.testing.assert_allclose(converted[name], expected, rtol=0, atol=1e-6, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    assert config["tie_word_embeddings"] is True


@pytest.mark.parametrize(("tensor_type", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_kept_quantized_weights_are_lossless_mlx_affine(
    tmp_path: Path, tensor_type: str, bits: int
) -> None:
    import mlx.core as mx

    weights = hf_weights()
    src = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, weights=weights)
    out = convert_gguf(src, tmp_path / "out", quantized=True)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits}
    loaded = mx.load(str(out / "model.safetensors"))
    assert isinstance(loaded, dict)
    module = "model.layers.1.self_attn.k_proj"
    assert loaded[f"{module}.scales"].dtype == mx.float32  # float16 scales crawl on the CPU
    restored = mx.dequantize(
        loaded[f"{module}.weight"],
        loaded[f"{module}.scales"],
        loaded[f"{module}.biases"],
        group_size=32,
        bits=bits,
    )
    expected = stored_values(weights[f"{module}.weight"], tensor_type)
    np.testing.assert_allclose(np.array(restored), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("tensor_type", "quantized", "float_dtype", "atol"),
    [
        ("F32", False, "float32", 1e-4),
        ("Q8_0", True, "float32", 1e-4),
        # The Metal / CUDA format: float16 activations round to ~1% of these logits (|x| < 7).
        ("Q4_1", True, "float16", 0.15),
    ],
)
def test_converted_model_loads_and_matches_the_hf_model(
    tmp_path: Path, tensor_type: str, quantized: bool, float_dtype: FloatDtype, atol: float
) -> None:
    """Same logits as mlx-lm's llama built directly from the HF-layout weights."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models import llama

    weights = {k: stored_values(v, tensor_type) for k, v in hf_weights(tied=False).items()}
    src = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, weights=weights)
    out = convert_gguf(src, tmp_path / "out", quantized=quantized, float_dtype=float_dtype)
    model, tokenizer = load(str(out))[:2]
    reference = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            intermediate_size=FFN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            rms_norm_eps=1e-5,
            vocab_size=len(tiny_vocab()[0]),
            rope_theta=10000.0,
            tie_word_embeddings=False,
        )
    )
    reference.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    ids = mx.array([tokenizer.encode("the thin hen 12")])
    logits = model(ids)
    assert logits.dtype == getattr(mx, float_dtype)
    np.testing.assert_allclose(
        np.array(logits.astype(mx.float32)), np.array(reference(ids)), atol=atol
    )


# --- refusals -----------------------------------------------------------------------------------


def test_unsupported_quant_type_is_named(tmp_path: Path) -> None:
    src = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q5_0")
    with pytest.raises(UnsupportedModelError, match=r"tensor type Q5_0 \(15 tensors"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    src = write_tiny_llama_gguf(tmp_path / "m.gguf", arch="qwen2")
    with pytest.raises(UnsupportedModelError, match="architecture 'qwen2'"):
        convert_gguf(src, tmp_path / "out")


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"tokenizer_model": "llama"}, "tokenizer model 'llama'"),
        ({"pre": "llama-bpe"}, "pre-tokenizer 'llama-bpe'"),
        ({"extra_tensors": {"rope_freqs.weight": np.ones(8, np.float32)}}, "rope_freqs.weight"),
    ],
)
def test_other_unsupported_parts_are_named(
    tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    header = read_header(write_tiny_llama_gguf(tmp_path / "m.gguf", **overrides))
    with pytest.raises(UnsupportedModelError, match=named):
        check_supported(header)


def test_unsupported_model_error_is_a_value_error() -> None:
    assert issubclass(UnsupportedModelError, ValueError)


# --- tokenizer ----------------------------------------------------------------------------------


def test_add_bos_token_reaches_the_loaded_tokenizer(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    src = write_tiny_llama_gguf(tmp_path / "m.gguf", add_bos=True)
    header = read_header(src)
    write_tokenizer(header, tmp_path)
    with_bos = load_tokenizer(tmp_path).encode("the hen")
    assert with_bos[0] == 1 and with_bos.count(1) == 1
    no_bos = tmp_path / "no-bos"
    no_bos.mkdir()
    write_tokenizer(read_header(write_tiny_llama_gguf(tmp_path / "n.gguf")), no_bos)
    assert load_tokenizer(no_bos).encode("the hen") == with_bos[1:]


TEXTS = [
    "Hello world! The quick brown fox.",
    "digits 12345 and pi 3.14159, 1,000,000.00 $5 2024-01-01",
    "naïve café — “quotes” ✓ ümlaut Ångström",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "中文字符和日本語のテキスト 한국어",
    "def f(x):\n    return x**2  # comment\n\n\tindented\r\n",
    "tabs\t\tand   runs of    spaces   \n\n\n  trailing  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we're they've",
    "<|endoftext|>x<|im_end|>",
    "\u00a0nbsp\u2003em-space\u200bzero-width",
]
# Whitespace before a digit: llama.cpp's "smollm" split (and SmolLM2's own tokenizer.json)
# isolates each digit first, so "  42" is "ĠĠ" "4" "2". transformers' GGUF builder applies
# only GPT-2's regex and yields "Ġ" "Ġ4"... which BPE spells "Ġ" "Ġ" "4" "2".
DIGIT_AFTER_SPACES = [" 123 x  42", "a  7", "x\n 3"]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from engine.errors import ModelDownloadError
    from engine.models.default_model import default_model_gguf

    try:
        return default_model_gguf()
    except ModelDownloadError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="module")
def tokenizers_pair(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    """(ours, transformers' GGUF builder) for SmolLM2, the latter fed by gguf's own reader.

    transformers' own GGUF file reader imports torch, so its builder is given the same
    dictionary it would build, read with the ``gguf`` package instead.
    """
    from tokenizers import Tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(str(smollm2_gguf))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    as_dict = {
        name: fields[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in fields
    }
    reference, _ = convert_gguf_tokenizer("llama", as_dict)
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    header = read_header(smollm2_gguf)
    for key, value in fields.items():  # our header parser agrees with llama.cpp's reader
        assert header.metadata[key] == value, key
    write_tokenizer(header, out)
    yield Tokenizer.from_file(str(out / "tokenizer.json")), reference


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers_gguf_builder(
    tokenizers_pair: tuple[Any, Any], text: str
) -> None:
    ours, reference = tokenizers_pair
    assert ours.encode(text).ids == reference.encode(text).ids
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_SPACES)
def test_token_ids_match_builder_with_smollm_digit_split(
    tokenizers_pair: tuple[Any, Any], text: str
) -> None:
    """With SmolLM2's own pre-tokenizer on transformers' vocabulary, every text agrees."""
    from tokenizers import pre_tokenizers

    ours, reference = tokenizers_pair
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    assert ours.encode(text).ids == reference.encode(text).ids


@pytest.mark.slow
def test_digits_are_split_after_whitespace(tokenizers_pair: tuple[Any, Any]) -> None:
    ours, _ = tokenizers_pair
    assert ours.encode("  42").tokens == ["ĠĠ", "4", "2"]
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_tokenizer_config_carries_template_and_special_tokens(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    header = read_header(smollm2_gguf)
    write_tokenizer(header, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == header.metadata["tokenizer.chat_template"]
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False
