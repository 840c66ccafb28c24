"""Convert a llama-family GGUF file into a directory that ``mlx_lm.load`` accepts.

A GGUF holds the weights, the model's hyper-parameters and its tokenizer (vocabulary, merges,
special tokens, chat template) as metadata. ``mx.load`` reads the tensors natively, returning
Q4_0 / Q4_1 / Q8_0 blocks as MLX affine (weight, scales, biases) triplets with group size 32,
so this module only renames tensors, undoes llama.cpp's q/k row permutation, and writes the
``config.json`` / ``tokenizer.json`` that mlx-lm expects.

The header (metadata and tensor types) is parsed here rather than taken from ``mx.load``:
for other block types ``mx.load`` either fails with an opaque message (Q5_0, Q5_1) or quietly
converts to float16 (BF16, whose range float16 lacks), so only the header tells which files
are really supported, and it lets an unsupported file be refused before any weight is read.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "FloatDtype",
    "GGUFHeader",
    "TensorInfo",
    "check_supported",
    "convert_gguf",
    "read_header",
    "write_tokenizer",
]

FloatDtype = Literal["float32", "float16"]
GROUP_SIZE = 32  # every block type mx.load unpacks holds 32 values per scale


# ggml tensor type ids (ggml.h), named so that errors can say which type is unsupported.
_GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# Exactly the types mx.load keeps lossless: plain floats, and the 32-value blocks that are affine
# quantization (w = d*q + m) and so become MLX's own quantized layout.
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# llama.cpp pre-tokenizer names whose split is "\p{N}" then the GPT-2 regex, which is the HF
# pre-tokenizer Digits(individual_digits=True) followed by ByteLevel(use_regex=True).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_PRE = frozenset({"gpt2", "default"})

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types


# --- reading the header -------------------------------------------------------------------------

_MAGIC = b"GGUF"
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it: row-major shape and its ggml type name."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (plain Python values) and tensor descriptions."""

    version: int
    metadata: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        """``general.architecture``, e.g. ``"llama"``."""
        return str(self.metadata.get("general.architecture", "<missing>"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata stored under the architecture's prefix, e.g. ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Sequential little-endian reads over a memory-mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, code: str) -> Any:
        """One value of ``struct`` format ``code``."""
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        """A GGUF string: a u64 byte length, then UTF-8 bytes."""
        length = self.scalar("Q")
        raw = self.buf[self.pos : self.pos + length]
        if len(raw) != length:
            raise struct.error("string runs past the end of the file")
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        """A metadata value of GGUF type ``value_type``; arrays become lists."""
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            code = _SCALAR_FORMATS[item_type]
            values = struct.unpack_from(f"<{count}{code}", self.buf, self.pos)
            self.pos += struct.calcsize(f"<{count}{code}")
            return list(values)
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading the tensor data.

    Raises ``ValueError`` for a file that is not a (complete) GGUF, and
    ``UnsupportedModelError`` for GGUF version 1, whose counts are 32-bit.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise ValueError(f"{os.fspath(path)} is not a GGUF file (bad magic number)")
        cursor = _Cursor(buf)
        cursor.pos = 4
        try:
            version = cursor.scalar("I")
            if version not in (2, 3):
                raise UnsupportedModelError(
                    f"{os.fspath(path)}: GGUF version {version} is unsupported (need 2 or 3)"
                )
            n_tensors, n_keys = cursor.scalar("Q"), cursor.scalar("Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_keys):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("I"))
            tensors = []
            for _ in range(n_tensors):
                name = cursor.string()
                dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
                type_id = cursor.scalar("I")
                cursor.scalar("Q")  # data offset: mx.load reads the data
                # ggml lists the fastest-varying dimension first; MLX is row-major.
                shape = tuple(reversed(dims))
                tensors.append(
                    TensorInfo(name, shape, _GGML_TYPE_NAMES.get(type_id, f"#{type_id}"))
                )
        except (struct.error, KeyError) as exc:
            raise ValueError(f"{os.fspath(path)}: corrupt or truncated GGUF header") from exc
    return GGUFHeader(version, metadata, tuple(tensors))


# --- deciding what is supported -----------------------------------------------------------------


def _hf_module(gguf_base: str) -> str | None:
    """HF module path for a GGUF tensor name without its suffix (``blk.3.attn_q``)."""
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    if len(parts) == 1:
        return _TOP_TENSORS.get(parts[0])
    return None


def _head_dim(header: GGUFHeader) -> int:
    """Per-head width: ``attention.key_length`` when given, else hidden size / heads."""
    hidden = int(header.arch_value("embedding_length", 0))
    n_head = int(header.arch_value("attention.head_count", 1))
    return int(header.arch_value("attention.key_length", hidden // max(n_head, 1)))


def check_supported(header: GGUFHeader) -> None:
    """Raise ``UnsupportedModelError`` listing everything in ``header`` this converter can't map.

    All problems are collected, so one error names every unsupported part of the file.
    """
    problems: list[str] = []
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        problems.append(
            f"architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    by_type: dict[str, list[str]] = {}
    for tensor in header.tensors:
        if tensor.ggml_type not in SUPPORTED_TENSOR_TYPES:
            by_type.setdefault(tensor.ggml_type, []).append(tensor.name)
    for type_name, names in sorted(by_type.items()):
        problems.append(
            f"tensor type {type_name} ({len(names)} tensors, e.g. {names[0]}; supported: "
            f"{', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
        )
    unknown = [t.name for t in header.tensors if _hf_module(t.name.rsplit(".", 1)[0]) is None]
    if unknown and arch in SUPPORTED_ARCHITECTURES:
        problems.append(f"tensors outside the llama layout: {', '.join(unknown[:5])}")
    if int(header.arch_value("expert_count", 0) or 0) > 0:
        problems.append("mixture-of-experts layers")
    scaling = header.arch_value("rope.scaling.type", "none")
    if scaling not in ("none", None):
        problems.append(f"rope scaling {scaling!r}")
    rope_dims = header.arch_value("rope.dimension_count")
    if arch in SUPPORTED_ARCHITECTURES and rope_dims not in (None, _head_dim(header)):
        problems.append(f"partial rotary embedding ({rope_dims} of {_head_dim(header)} dims)")
    tokenizer_model = header.metadata.get("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        problems.append(f"tokenizer model {tokenizer_model!r} (supported: 'gpt2' byte-level BPE)")
    elif not header.metadata.get("tokenizer.ggml.tokens"):
        problems.append("no tokenizer vocabulary (tokenizer.ggml.tokens)")
    else:
        pre = header.metadata.get("tokenizer.ggml.pre", "default")
        if pre not in _DIGIT_SPLIT_PRE | _GPT2_PRE:
            problems.append(f"pre-tokenizer {pre!r}")
    if problems:
        raise UnsupportedModelError("unsupported GGUF: " + "; ".join(problems))


# --- weights ------------------------------------------------------------------------------------


def _load_weights(
    path: Path, header: GGUFHeader, *, quantized: bool, float_dtype: FloatDtype
) -> tuple[dict[str, Any], dict[str, int]]:
    """HF-named weights and, for modules kept quantized, their bit width."""
    from engine.device.loading.weights import load_gguf_weights

    renamed: dict[str, str] = {}
    for tensor in header.tensors:
        base = tensor.name.rsplit(".", 1)[0]
        module = _hf_module(base)
        assert module is not None  # check_supported rejected every unmapped name
        renamed[base] = module
    n_head = int(header.arch_value("attention.head_count"))
    n_kv = int(header.arch_value("attention.head_count_kv", n_head))
    return load_gguf_weights(path, renamed, n_head=n_head, n_kv=n_kv, quantized=quantized,
                             float_dtype=float_dtype, group_size=GROUP_SIZE)


# --- config and tokenizer -----------------------------------------------------------------------


def _token_id(header: GGUFHeader, key: str) -> int | None:
    """A special token's id (``bos_token_id``...), or None when the file names none."""
    value = header.metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def _model_config(
    header: GGUFHeader, bits: dict[str, int], float_dtype: FloatDtype
) -> dict[str, Any]:
    """``config.json`` for mlx-lm's llama model."""
    n_head = int(header.arch_value("attention.head_count"))
    eos = _token_id(header, "eos_token_id")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(header.arch_value("embedding_length")),
        "intermediate_size": int(header.arch_value("feed_forward_length")),
        "num_hidden_layers": int(header.arch_value("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(header.arch_value("attention.head_count_kv", n_head)),
        "head_dim": _head_dim(header),
        "rms_norm_eps": float(header.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(header.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(header.arch_value("context_length", 2048)),
        "vocab_size": len(header.metadata["tokenizer.ggml.tokens"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors),
        "bos_token_id": _token_id(header, "bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _token_id(header, "padding_token_id"),
        "torch_dtype": float_dtype,
    }
    if bits:
        # The most common width is the default; GGUFs often mix in Q8_0 embeddings.
        default_bits = Counter(bits.values()).most_common(1)[0][0]
        quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
        for module, module_bits in sorted(bits.items()):
            if module_bits != default_bits:
                quantization[module] = {"group_size": GROUP_SIZE, "bits": module_bits}
        config["quantization"] = quantization
        config["quantization_config"] = dict(quantization)
    return config


def _byte_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    from tokenizers import pre_tokenizers

    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def write_tokenizer(header: GGUFHeader, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Mirrors transformers' own GGUF tokenizer builder (vocabulary respelled into the byte
    alphabet, CONTROL tokens special, USER_DEFINED tokens added) but with the pre-tokenizer
    llama.cpp uses for the file's ``tokenizer.ggml.pre``: SmolLM splits every digit first.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = header.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()

    def spelled(token: str) -> str:
        # Normal tokens are stored byte-spelled already; raw text must be respelled to match.
        if set(token) <= alphabet:
            return token
        return _respell(token)

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre", "default") in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    bos = _token_id(header, "bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    byte_post = processors.ByteLevel(trim_offsets=False)
    if add_bos and bos is not None:
        bos_text = tokens[bos]
        tokenizer.post_processor = processors.Sequence([
            byte_post,
            processors.TemplateProcessing(
                single=f"{bos_text}:0 $A:0",
                pair=f"{bos_text}:0 $A:0 {bos_text}:1 $B:1",
                special_tokens=[(bos_text, bos)],
            ),
        ])  # fmt: skip
    else:
        tokenizer.post_processor = byte_post

    # A CONTROL token outside the byte alphabet is a llama.cpp mislabel: transformers skips it.
    kinds = list(zip(tokens, types, strict=True))
    control = [t for t, kind in kinds if kind == _TOKEN_CONTROL and set(t) <= alphabet]
    user = [t for t, kind in kinds if kind == _TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def text_of(key: str) -> str | None:
        token_id = _token_id(header, key)
        return None if token_id is None else tokens[token_id]

    special = {
        "bos_token": text_of("bos_token_id"),
        "eos_token": text_of("eos_token_id"),
        "pad_token": text_of("padding_token_id"),
        "unk_token": text_of("unknown_token_id"),
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(header.arch_value("context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _respell(token: str) -> str:
    """A raw-text token spelled in GPT-2's byte alphabet."""
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in pieces.pre_tokenize_str(token))


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Pretty, UTF-8 JSON (chat templates and tokens keep their characters)."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _wrote(path)


# A test seam: a process converting with this set to a file name (``config.json``) says so on
# stderr once that file is written and then blocks forever, so a test can kill it at a known
# point in the middle of a conversion. Unset (always, outside tests) it costs one lookup a file.
PAUSE_ENV_VAR = "MLX_PROVIDERS_TEST_PAUSE_CONVERSION_AFTER"


def _wrote(path: Path) -> None:
    if os.environ.get(PAUSE_ENV_VAR) == path.name:
        print(f"{PAUSE_ENV_VAR}: paused after writing {path}", file=sys.stderr, flush=True)
        threading.Event().wait()


# --- the conversion -----------------------------------------------------------------------------


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    quantized: bool = False,
    float_dtype: FloatDtype = "float32",
) -> Path:
    """Write an mlx-lm model directory for a llama-family GGUF into ``out_dir``.

    ``quantized=False`` dequantizes every block-quantized tensor; ``quantized=True`` keeps
    Q4_0 / Q4_1 / Q8_0 tensors as MLX affine quantized weights (lossless). ``float_dtype`` is
    the dtype of every floating tensor written: weights, scales, biases and norms.

    ``out_dir`` is created if needed and written in place; callers wanting atomicity write
    into a temporary directory and rename it (see ``engine.models.user_cache``).
    Raises ``UnsupportedModelError`` before reading any weights if the file can't be mapped.
    """
    from engine.device.loading.weights import save_weights

    src, out = Path(gguf_path), Path(out_dir)
    header = read_header(src)
    check_supported(header)
    out.mkdir(parents=True, exist_ok=True)
    weights, bits = _load_weights(src, header, quantized=quantized, float_dtype=float_dtype)
    save_weights(out / "model.safetensors", weights)
    _wrote(out / "model.safetensors")
    del weights
    config = _model_config(header, bits, float_dtype)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )
    write_tokenizer(header, out)
    meta = header.metadata
    kinds = Counter(t.ggml_type for t in header.tensors)
    (out / "README.md").write_text(
        f"Converted by mlx-providers from {src.name} ({meta.get('general.name', 'unnamed')}, "
        f"license: {meta.get('general.license', 'unknown')}).\n"
        f"GGUF tensor types: {dict(kinds)}; written as "
        f"{'quantized ' + str(sorted(set(bits.values()))) + '-bit, ' if bits else ''}"
        f"{float_dtype}.\n",
        encoding="utf-8",
    )
    return out
