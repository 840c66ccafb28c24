"""Build a tiny qwen2-shaped model directory that ``mlx_lm.load`` accepts, in seconds.

Random weights (seeded) and a byte-level BPE tokenizer trained on local Python stdlib
sources, with a ChatML chat template that renders tools, tool calls and tool results.
Nothing is downloaded. Used by the test suite and the benchmarks.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with a tools section; the tool-call format matches mlx-lm's "json_tools" parser.
CHAT_TEMPLATE = (
    "{%- set first_system = messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{{- messages[0].content if first_system else 'You are a helpful assistant.' -}}"
    "{%- if tools -%}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and first_system) -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + (message.content | string) "
    "+ '\n</tool_response><|im_end|>\n' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function is defined -%}"
    "{%- set tool_call = tool_call.function -%}"
    "{%- endif -%}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' -}}"
    "{{- tool_call.arguments if tool_call.arguments is string "
    "else (tool_call.arguments | tojson) -}}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def corpus(limit_bytes: int = 2_000_000) -> list[str]:
    stdlib = os.path.dirname(os.__file__)
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        files.append(path)
        total += os.path.getsize(path)
        if total > limit_bytes:
            break
    return files


def train_tokenizer(vocab_size: int) -> object:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(corpus(), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def build_tiny_model(
    out: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    vocab: int = 2048,
    context: int = 2048,
    seed: int = 0,
    weight_scale: float = 4.0,
    thinking: bool = False,
) -> Path:
    """Write the model directory to ``out`` (created) and return it."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_config, save_model

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab)
    if thinking:  # mlx-lm then treats it as a reasoning model (has_thinking)
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)  # type: ignore[attr-defined]
                              for t in ("<think>", "</think>")])
    tokenizer.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)  # type: ignore[attr-defined]
    eos = tokenizer.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": (n_vocab + 63) // 64 * 64,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    # Default init makes a model this small repeat one token forever; larger weights
    # give varied greedy continuations, which makes determinism tests meaningful.
    model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(dict(config), out / "config.json")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_model(Path(sys.argv[1])))
