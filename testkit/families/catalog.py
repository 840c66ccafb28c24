"""The model families the tests cover: each one's architecture, vocabulary, template and
tokens, and what the tests expect of it.

A family is one row of ``FAMILIES``; every test of ``tests/families`` and the family tables
of docs/models.md (``testkit.families.docs_tables``) read it from here. Every family names
the mlx-lm ``model_type`` its published checkpoints load as (wrappers with their language
model under ``text_config`` included), the vocabulary its tokenizer is built from, the
published chat template (a file of the llama-cpp-python sdist), its added tokens at the ids
its published tokenizer gives them, and the tokenizer_config keys a real checkpoint
carries, so that mlx-lm's ``TokenizerWrapper`` infers the same tool parser and thinking
markers as for the real model. ``stand_in`` says where the offline sources fall short of
the real model (a vocabulary not on PyPI, a template not in the sdist); ``expected`` is what
the tests expect of it (``testkit.families.expectations``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testkit.families.expectations import TAGGED_CALL, Expected, Reasoning
from testkit.families.vocabularies import AddedToken


@dataclass(frozen=True)
class Vocabulary:
    """Where a tokenizer's vocabulary comes from: ``kind`` is ``gguf`` (a llama.cpp vocab
    file, by name), ``tiktoken`` (``o200k`` / ``cl100k``) or ``tekken`` (a mistral-common
    file, by name); ``vectors`` names the GGUF whose ``.inp``/``.out`` check it."""

    kind: str
    name: str
    vectors: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family as a tiny model of it is built (``testkit.families.build``)."""

    name: str
    model_type: str
    template: str
    vocabulary: Vocabulary
    vocab_size: int
    added: dict[int, AddedToken]
    tokenizer_config: dict[str, Any]
    eos: tuple[str, ...]
    config: dict[str, Any] = field(default_factory=dict)
    text_config: dict[str, Any] | None = None  # the wrapper's language model, when nested
    stand_in: str = ""
    title: str = field(default="", kw_only=True)  # how the docs name it ("Llama 3.1")
    expected: Expected = field(kw_only=True)


def _special(*pairs: tuple[int, str]) -> dict[int, AddedToken]:
    return {token_id: AddedToken(content) for token_id, content in pairs}


def _plain(*pairs: tuple[int, str]) -> dict[int, AddedToken]:
    return {token_id: AddedToken(content, special=False) for token_id, content in pairs}


# Qwen2.5/Qwen3's added tokens (tokenizer_config.json of Qwen/Qwen3-0.6B): in llama.cpp's
# qwen2 vocab file these ids hold [PAD151646]... placeholders.
QWEN_ADDED = {
    **_special((151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>"),
               (151646, "<|object_ref_start|>"), (151647, "<|object_ref_end|>"),
               (151648, "<|box_start|>"), (151649, "<|box_end|>"), (151650, "<|quad_start|>"),
               (151651, "<|quad_end|>"), (151652, "<|vision_start|>"),
               (151653, "<|vision_end|>"), (151654, "<|vision_pad|>"),
               (151655, "<|image_pad|>"), (151656, "<|video_pad|>")),
    **_plain((151657, "<tool_call>"), (151658, "</tool_call>"), (151659, "<|fim_prefix|>"),
             (151660, "<|fim_middle|>"), (151661, "<|fim_suffix|>"), (151662, "<|fim_pad|>"),
             (151663, "<|repo_name|>"), (151664, "<|file_sep|>"), (151665, "<tool_response>"),
             (151666, "</tool_response>"), (151667, "<think>"), (151668, "</think>")),
}
QWEN_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "add_bos_token": False, "tokenizer_class": "Qwen2Tokenizer"}

def _ds(words: str) -> str:
    """A DeepSeek token: fullwidth bars around words joined by U+2581 ("▁")."""
    return "<\uff5c" + "\u2581".join(words.split()) + "\uff5c>"


# DeepSeek-R1-Distill-Qwen's 22 added tokens (tokenizer_config.json of the 1.5B to 32B
# distills): its own at 151643-151649 where Qwen2.5 has its ChatML and object-ref tokens,
# then Qwen2.5's from 151650 to 151664. Its tool markers are no tokens: the template writes
# them as text, which the vocabulary splits into ordinary tokens.
DEEPSEEK_R1_ADDED = {
    **_special((151643, _ds("end of sentence"))),
    **_plain((151644, _ds("User")), (151645, _ds("Assistant"))),
    **_special((151646, _ds("begin of sentence"))),
    **_plain((151647, "<|EOT|>"), (151648, "<think>"), (151649, "</think>")),
    **{token_id: QWEN_ADDED[token_id] for token_id in range(151650, 151665)},
}

# Llama 3.1/3.2 name reserved ids the Llama 3 vocab file still calls reserved.
LLAMA31_ADDED = _special((128004, "<|finetune_right_pad_id|>"), (128008, "<|eom_id|>"),
                         (128010, "<|python_tag|>"))
LLAMA_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# SmolLM3 repurposes Llama 3's reserved ids for ChatML and thinking.
SMOLLM3_ADDED = {**_plain((128002, "<think>"), (128003, "</think>")),
                 **_special((128004, "<|finetune_right_pad_id|>"), (128011, "<|im_start|>"),
                            (128012, "<|im_end|>"))}

# gpt-oss's harmony tokens over o200k_base (openai-harmony's o200k_harmony encoding).
HARMONY_ADDED = _special(
    (199998, "<|startoftext|>"), (199999, "<|endoftext|>"), (200000, "<|reserved_200000|>"),
    (200001, "<|reserved_200001|>"), (200002, "<|return|>"), (200003, "<|constrain|>"),
    (200004, "<|reserved_200004|>"), (200005, "<|channel|>"), (200006, "<|start|>"),
    (200007, "<|end|>"), (200008, "<|message|>"), (200009, "<|reserved_200009|>"),
    (200010, "<|reserved_200010|>"), (200011, "<|reserved_200011|>"), (200012, "<|call|>"),
    *((i, f"<|reserved_{i}|>") for i in range(200013, 200018)), (200018, "<|endofprompt|>"),
)

# Mistral's control tokens (mistral-common's SpecialTokens, Tekken v13 layout): ids 0-999.
_MISTRAL_NAMED = {
    0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]",
    6: "[/AVAILABLE_TOOLS]", 7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]",
    10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]", 13: "[IMG_END]", 14: "[PREFIX]",
    15: "[MIDDLE]", 16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]", 32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]",
}
MISTRAL_ADDED = {i: AddedToken(_MISTRAL_NAMED.get(i, f"<SPECIAL_{i}>")) for i in range(1000)}
MISTRAL_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                  "pad_token": "<pad>", "add_bos_token": True,
                  "tokenizer_class": "PreTrainedTokenizerFast"}

# Gemma 3 has <start_of_turn>/<end_of_turn> at the ids Gemma 4 gives <|turn>/<turn|>; the
# other Gemma 4 markers (tool calls, thinking channel) are unused slots in Gemma 3.
GEMMA3_ADDED = {
    **_special((105, "<start_of_turn>"), (106, "<end_of_turn>")),
    **_special(*((i, f"<unused_slot_{i}>") for i in (46, 47, 48, 49, 50, 51, 52, 98, 100, 101))),
}
GEMMA_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                "unk_token": "<unk>", "add_bos_token": False,
                "tokenizer_class": "GemmaTokenizer"}

PHI3_CONFIG = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
               "pad_token": "<|endoftext|>", "add_bos_token": False,
               "tokenizer_class": "LlamaTokenizer"}

# Granite 4's role tokens over cl100k_base's ids (its 100k vocabulary extends cl100k).
GRANITE_ADDED = _special((100257, "<|end_of_text|>"), (100264, "<|start_of_role|>"),
                         (100265, "<|end_of_role|>"))
GRANITE_CONFIG = {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>",
                  "pad_token": "<|end_of_text|>", "add_bos_token": False,
                  "tokenizer_class": "GPT2Tokenizer"}

# LFM2's ChatML and tool-list tokens, placed in Llama 3's reserved ids (stand-in vocabulary).
LFM2_ADDED = _special((128002, "<|im_start|>"), (128003, "<|im_end|>"),
                      (128004, "<|tool_list_start|>"), (128005, "<|tool_list_end|>"),
                      (128011, "<|tool_call_start|>"), (128012, "<|tool_call_end|>"),
                      (128013, "<|tool_response_start|>"), (128014, "<|tool_response_end|>"),
                      (128015, "<|pad|>"))
LFM2_LAYERS = {"layer_types": ["conv", "full_attention", "conv", "full_attention"],
               "conv_L_cache": 3, "conv_bias": False, "block_dim": 64, "block_multiple_of": 32,
               "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
               "block_ff_dim": 128, "norm_eps": 1e-5}

_QWEN2_VOCAB = Vocabulary("gguf", "qwen2", vectors="qwen2")
_LLAMA_VOCAB = Vocabulary("gguf", "llama-bpe", vectors="llama-bpe")
_GEMMA_VOCAB = Vocabulary("gguf", "gemma-4", vectors="gemma-4")
_TEKKEN = Vocabulary("tekken", "tekken_240911")

# How the families reason, and the calls several of them write alike.
_THINK_TAGS = Reasoning("<think>\n", "\n</think>\n\n")
_LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
# Where the template renders no calls, the engine writes past calls as tagged JSON lines.
_PLAIN_HISTORY_CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                       "</tool_call>")
_DS_CALL = (_ds("tool calls begin") + _ds("tool call begin") + "function" + _ds("tool sep")
            + 'get_weather\n```json\n{"city": "Paris"}\n```' + _ds("tool call end")
            + _ds("tool calls end"))

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "qwen3", "Qwen-Qwen3-0.6B", _QWEN2_VOCAB, 151936, QWEN_ADDED,
           QWEN_CONFIG, ("<|im_end|>", "<|endoftext|>"), {"tie_word_embeddings": True},
           title="Qwen3",
           expected=Expected("tagged-json", "<|im_end|>", TAGGED_CALL, "json_tools", "<think>",
                             reasoning=_THINK_TAGS, reference_texts=47, fitted=True)),
    Family("qwen3_5", "qwen3_5", "Qwen3.5-4B", Vocabulary("gguf", "qwen35", vectors="qwen35"),
           151936, QWEN_ADDED, QWEN_CONFIG, ("<|im_end|>", "<|endoftext|>"),
           text_config={"model_type": "qwen3_5_text", "tie_word_embeddings": True},
           stand_in="llama.cpp's qwen35 vocab file carries Qwen2's 151,936 tokens with "
                    "Qwen3.5's pre-tokenizer; the published Qwen3.5 vocabulary is larger",
           title="Qwen3.5",
           expected=Expected("qwen-xml", "<|im_end|>",
                             "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                             "</parameter>\n</function>\n</tool_call>", "qwen3_coder", "<think>",
                             reasoning=_THINK_TAGS, reference_texts=51, fitted=True)),
    Family("llama3_1", "llama", "meta-llama-Llama-3.1-8B-Instruct", _LLAMA_VOCAB, 128256,
           LLAMA31_ADDED, LLAMA_CONFIG, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
           {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072},
           title="Llama 3.1",
           expected=Expected("llama3-json", "<|eot_id|>", _LLAMA_CALL, reference_texts=47,
                             fitted=True)),
    Family("llama3_2", "llama", "meta-llama-Llama-3.2-3B-Instruct", _LLAMA_VOCAB, 128256,
           LLAMA31_ADDED, LLAMA_CONFIG, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
           {"rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
            "max_position_embeddings": 131072},
           title="Llama 3.2",
           expected=Expected("llama3-json", "<|eot_id|>", _LLAMA_CALL, reference_texts=47)),
    Family("gemma4", "gemma4", "google-gemma-4-31B-it", _GEMMA_VOCAB, 262144, {},
           GEMMA_CONFIG, ("<eos>", "<turn|>"),
           # The 31B has no per-layer input embeddings (those are the E2B/E4B models').
           text_config={"model_type": "gemma4_text", "tie_word_embeddings": True,
                        "hidden_size_per_layer_input": 0},
           title="Gemma 4",
           expected=Expected("gemma4", "<turn|>",
                             '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
                             "gemma4", "<|channel>thought",
                             reasoning=Reasoning("<|channel>thought\n", "<channel|>"),
                             reference_texts=46, fitted=True)),
    Family("gemma3", "gemma3_text", "google-gemma-2-2b-it", _GEMMA_VOCAB, 262144,
           GEMMA3_ADDED, GEMMA_CONFIG, ("<eos>", "<end_of_turn>"),
           stand_in="Gemma 3's vocabulary is not on PyPI: Gemma 4's, with Gemma 3's turn "
                    "tokens at their ids 105/106; no Gemma 3 template is in the sdist: "
                    "Gemma 2's, which Gemma 3's extends with a system prompt",
           title="Gemma 3",
           expected=Expected("tagged-json", "<end_of_turn>", TAGGED_CALL,
                             cannot_render={"tools": "dropped", "call": "dropped",
                                            "result": "raises"},
                             history_call=_PLAIN_HISTORY_CALL, refuses_system=True,
                             reference_texts=46)),
    Family("gpt_oss", "gpt_oss", "openai-gpt-oss-120b", Vocabulary("tiktoken", "o200k"),
           201088, HARMONY_ADDED,
           {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
            "pad_token": "<|endoftext|>", "add_bos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast"},
           ("<|return|>", "<|endoftext|>", "<|call|>"),
           title="gpt-oss",
           # Its forced calls use the form of OpenAI's harmony guide; its template renders
           # the recipient before the channel (both are read back).
           expected=Expected("harmony", "<|return|>",
                             "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                             '<|message|>{"city": "Paris"}<|call|>',
                             unforced_call=" to=functions.get_weather<|channel|>commentary "
                                           'json<|message|>{"city": "Paris"}',
                             end_of_call="<|call|>",
                             reasoning=Reasoning("<|channel|>analysis<|message|>",
                                                 "<|end|><|start|>assistant<|channel|>final"
                                                 "<|message|>",
                                                 switches={"reasoning_effort": "high"}),
                             reference_texts=46, fitted=True)),
    Family("mistral_small_3_2", "mistral3", "Mistral-Small-3.2-24B-Instruct-2506", _TEKKEN,
           131072, MISTRAL_ADDED, MISTRAL_CONFIG, ("</s>",),
           text_config={"model_type": "mistral", "tie_word_embeddings": False},
           stand_in="Tekken from mistral-common 1.13.1's tekken_240911.json (the v3 file "
                    "PyPI ships); control tokens at mistral-common's v13 ids",
           title="Mistral Small 3.2",
           expected=Expected("mistral", "</s>",
                             '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
                             "mistral", reference_texts=46, fitted=True)),
    Family("ministral3_reasoning", "mistral3", "mistralai-Ministral-3-14B-Reasoning-2512",
           _TEKKEN, 131072, MISTRAL_ADDED, MISTRAL_CONFIG, ("</s>",),
           text_config={"model_type": "ministral3", "tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "llama_4_scaling_beta": 0.1,
                                            "original_max_position_embeddings": 4096}},
           stand_in="Tekken as for Mistral Small 3.2",
           title="Ministral 3",
           expected=Expected("mistral", "</s>", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                             "mistral", reasoning=Reasoning("[THINK]", "[/THINK]"),
                             reference_texts=46)),
    Family("phi3_5", "phi3", "microsoft-Phi-3.5-mini-instruct",
           Vocabulary("gguf", "phi-3", vectors="phi-3"), 32064, {}, PHI3_CONFIG,
           ("<|endoftext|>", "<|end|>", "<|assistant|>"),
           {"partial_rotary_factor": 1.0,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                             "long_factor": [1.0] * 8},
            "original_max_position_embeddings": 4096, "max_position_embeddings": 131072},
           title="Phi-3.5",
           expected=Expected("tagged-json", "<|end|>", TAGGED_CALL,
                             cannot_render={"tools": "dropped", "call": "dropped",
                                            "result": "dropped"},
                             history_call=_PLAIN_HISTORY_CALL, reference_texts=47)),
    Family("granite4", "granitemoehybrid", "ibm-granite-granite-4.0",
           Vocabulary("tiktoken", "cl100k"), 100352, GRANITE_ADDED, GRANITE_CONFIG,
           ("<|end_of_text|>",),
           {"layer_types": ["mamba", "attention", "mamba", "attention"],
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False,
            "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
            "mamba_conv_bias": True, "mamba_expand": 2, "shared_intermediate_size": 64,
            "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0, "residual_multiplier": 0.22, "num_local_experts": 0,
            "tie_word_embeddings": True},
           stand_in="Granite 4's vocabulary is cl100k_base's ranks (from llama-index-core's "
                    "tiktoken cache) with its role tokens at assumed ids",
           title="Granite 4",
           expected=Expected("tagged-json", "<|end_of_text|>", TAGGED_CALL, "json_tools",
                             reference_texts=46, fitted=True)),
    Family("lfm2", "lfm2", "LFM2-8B-A1B", _LLAMA_VOCAB, 128256, LFM2_ADDED,
           {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
            "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"},
           ("<|im_end|>",), {**LFM2_LAYERS, "tie_word_embeddings": True},
           stand_in="LFM2's 65,536-token vocabulary is not on PyPI: Llama 3's (the same "
                    "pre-tokenizer split), its ChatML and tool tokens in reserved ids",
           title="LFM2",
           # Its template renders no tool_calls: the documented form, which its dialect
           # writes into a past assistant turn.
           expected=Expected("pythonic", "<|im_end|>",
                             '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
                             "pythonic",
                             cannot_render={"call": "dropped (LFM2 writes calls in the content)"},
                             reference_texts=47, fitted=True)),
    Family("smollm3", "smollm3", "HuggingFaceTB-SmolLM3-3B", _LLAMA_VOCAB, 128256,
           SMOLLM3_ADDED,
           {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"},
           ("<|im_end|>",), {"tie_word_embeddings": True, "no_rope_layer_interval": 4},
           title="SmolLM3",
           # The sdist's template (Unsloth's edit) reads neither tools= nor the published
           # template's xml_tools= and carries SmolLM's default system prompt: the engine
           # lists tools, and writes past calls, in SmolLM2's format.
           expected=Expected("tagged-json", "<|im_end|>", TAGGED_CALL, think_start="<think>",
                             cannot_render={"tools": "dropped", "xml_tools": "dropped",
                                            "call": "dropped"},
                             history_call='<tool_call>[\n{"name": "get_weather", "arguments": '
                                          '{"city": "Paris"}}\n]</tool_call>',
                             reasoning=Reasoning("<think>\n", "\n</think>\n"),
                             reference_texts=47)),
    Family("deepseek_r1_qwen", "qwen2", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
           _QWEN2_VOCAB, 152064, DEEPSEEK_R1_ADDED,
           {"bos_token": _ds("begin of sentence"), "eos_token": _ds("end of sentence"),
            "pad_token": _ds("end of sentence"), "unk_token": None, "add_bos_token": True,
            "add_eos_token": False, "legacy": True, "tokenizer_class": "LlamaTokenizerFast"},
           (_ds("end of sentence"),), {"tie_word_embeddings": False},
           title="DeepSeek-R1-Distill",
           expected=Expected("deepseek-r1", _ds("end of sentence"), _DS_CALL,
                             think_start="<think>", cannot_render={"tools": "dropped"},
                             reasoning=_THINK_TAGS, reference_texts=47, fitted=True)),
)}


def one_per_dialect() -> list[str]:
    """One family of each dialect the catalog covers: the first in the catalog's order."""
    firsts: dict[str, str] = {}
    for family in FAMILIES.values():
        firsts.setdefault(family.expected.dialect, family.name)
    return list(firsts.values())
