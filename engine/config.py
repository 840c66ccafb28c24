"""EngineConfig: the engine's knobs, validated at the boundary (bad values -> ValueError)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# What names a model: None (the default model), a local path (a directory or a .gguf file)
# or a hub id. The facade, the registry and a sharded engine's followers all take it.
ModelSpec = str | os.PathLike[str] | None


class EngineConfig(BaseModel):
    """How one engine batches, prefills and budgets memory.

    Invalid values raise ``pydantic.ValidationError`` (a ``ValueError``) naming the field.
    Types are strict: ``"4"``, ``4.0`` or ``True`` is not a ``max_batch`` (lax coercion
    accepted them silently), and no number is infinite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    max_batch: int = Field(
        default=32, ge=1, le=1024, description="Rows decoding together; 1 = off."
    )
    prefill_batch: int = Field(
        default=8, ge=1, le=1024, description="Prompts prefilled together."
    )
    prefill_chunk: int = Field(
        default=512, ge=8, le=65536,
        description="Prompt tokens per prefill step; bounds how long decoding rows wait.",
    )
    kv_budget_bytes: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description="Cap on the worst-case KV bytes of all running rows plus the prefix "
        "store, which gives way first. 'auto': a quarter of the memory left beside the "
        "weights (RAM, cgroup limit or GPU working set); None = no cap. See docs/memory.md.",
    )
    max_kv_size: int | None = Field(
        default=None, ge=16,
        description="Use a rotating KV cache of this many tokens for models without their own.",
    )
    kv_bits: Literal[4, 8] | None = Field(
        default=None,
        description="Keep every row's attention keys and values quantized to this many bits "
        "(groups of kv_group_size along the head, float16 scales and biases), inside the "
        "shared batch: about 0.27x (8) or 0.14x (4) of float32's bytes a token, so the KV "
        "budget admits that many more rows. None: the model's own dtype. Attention reads "
        "the quantized blocks (MLX's quantized matmuls). docs/memory.md has its cost.",
    )
    kv_quantized_start: int = Field(
        default=0, ge=0,
        description="mlx-lm's quantized_kv_start (keep KV in float until a request's cache "
        "passes this many tokens, then quantize it): only 0 is served, every token "
        "quantized from the first. In a shared batch a row's switch would follow its "
        "siblings' lengths (one cache holds the batch), so a row's tokens would depend on "
        "who else runs; any other value is refused by name.",
    )
    kv_dtype: Literal["float16"] | None = Field(
        default=None,
        description="Keep every row's attention keys and values in float16 on a float32 "
        "model (the CPU's): 0.5x of float32's bytes a token, in the shared batch, with "
        "queries and the rest of the forward in float32. None: the model's own dtype. "
        "kv_bits=8 takes fewer bytes still at no measured cost; docs/memory.md compares.",
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        default=64,
        description="Head-dimension values sharing one scale and bias under kv_bits; must "
        "divide the model's head size.",
    )
    quantized: bool | None = Field(
        default=None,
        description="Keep quantized weights (True) or dequantize to float32 (False); "
        "None picks per backend: quantized on Metal/CUDA and on the CPU with this package's "
        "CPU kernels; without them float32 on the CPU when it fits in half the memory "
        "(MLX's own quantized CPU ops are slow). stats().weight_format says which.",
    )
    cpu_int8: bool = Field(
        default=False,
        description="On the CPU kernels, round each quantized product's activations to int8 "
        "blocks of 32 (as llama.cpp does) where the CPU has the int8 path (AVX-512 VNNI): "
        "faster decoding of one or a few rows, at ~1% error a product, so tokens can differ "
        "from the float32 path's. Batched still equals alone. stats().cpu_kernels says "
        "whether it runs.",
    )
    prefix_cache_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="Byte cap of the reusable prompt-prefix KV cache (0 = off), inside the "
        "KV budget. 'auto': an eighth of the machine's automatic KV budget, at most 1 GiB "
        "and never above kv_budget_bytes.",
    )
    vision_cache_bytes: Annotated[int, Field(ge=0)] = Field(
        default=256 << 20,
        description="Byte cap of the vision features kept per image (an LRU keyed by the "
        "image's pixels and preprocessing), so a conversation's later turns over the same "
        "image skip the vision tower. 0 = keep none. Vision-language models only.",
    )
    vision_step_share: Annotated[float, Field(gt=0)] = Field(
        default=0.08,
        description="While rows decode, the share of a decode step's time an image row's "
        "own work (its tower, a block at a time, and its prefill chunks) may add to a step, "
        "so the decoding rows keep ~1/(1+share) of their pace; the image waits longer for "
        "its first token. With no row decoding, image work runs at full speed.",
    )
    adapter_bytes: Annotated[int, Field(ge=0)] = Field(
        default=512 << 20,
        description="Byte cap of the LoRA adapters loaded at once (SamplingParams.adapter), "
        "least recently used first out; an adapter a row uses is never evicted.",
    )
    buffer_cache_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="Cap on the freed buffers MLX keeps for reuse (mx.set_cache_limit, "
        "process-wide). 'auto': on a GPU a sixteenth of the KV budget, 32 MiB to 1 GiB; "
        "on CPU 32 MiB (MLX's CPU default).",
    )
    prefix_cache_ttl: float | None = Field(
        default=600.0, gt=0, description="Seconds a stored prefix may be reused (None = no TTL).",
    )
    prefix_cache_dir: str | None = Field(
        default=None,
        description="A directory where the prefix store's entries are also written (in the "
        "background, never blocking a step), so a restarted engine reuses prompts it saw "
        "before: a long agent head is read back instead of prefilled. Keyed by the model's "
        "files, its cache layout and the engine's version: another model or version never "
        "reads them; damaged files are skipped with a warning. None = memory only.",
    )
    prefix_cache_disk_bytes: int = Field(
        default=8 << 30, ge=0,
        description="Byte cap of prefix_cache_dir (least recently used files go first).",
    )
    prefix_min_tokens: int = Field(
        default=16, ge=1, description="Shortest prefix worth storing or reusing.",
    )
    admission_window: float = Field(
        default=0.0, ge=0, le=1.0,
        description="Seconds an idle engine waits, after a request arrives, for more to "
        "start with it in one prefill group (ends once prefill_batch are waiting). A burst "
        "of HTTP requests reaches a server spread over tens of ms; started alone, the first "
        "makes the rest wait for its first token. Each request on an idle engine pays up "
        "to this much more latency (0 = start at once).",
    )
    fast_forward: bool = Field(
        default=True,
        description="Constrained rows (tool calls, schemas, regexes) append the tokens their "
        "grammar forces in one forward pass instead of one decode step each; they reach "
        "streams, callbacks, stop strings and usage as ordinary tokens, with logprob 0. "
        "False decodes them one step at a time.",
    )
    speculation: int = Field(
        default=1, ge=0, le=64,
        description="Prompt-lookup speculation while at most this many rows run (0 = off): "
        "greedy rows without logits processors or penalties (constrained ones with "
        "fast_forward, and rows asking for logprobs too) draft their next tokens "
        "from their own prompt and output and check the draft in one forward, keeping what "
        "the model agrees with (the output is the same greedy text). A row's drafts are "
        "first compared with what it decodes in the batch; only rows whose drafts would be "
        "accepted often enough for the load pay for a check. Default 1: measured here, it "
        "paid at one row (2.2x on an answer quoting its context) and cost up to 12% at two "
        "rows on a load whose drafts fail.",
    )
    embed_window: float = Field(
        default=0.005, ge=0, le=1.0,
        description="Seconds an embedding request waits for others to share its batch "
        "(requests from any thread or event loop run as one encoder call).",
    )
    embed_max_batch: int = Field(
        default=64, ge=1, le=4096,
        description="Texts in one embedding batch; a batch runs between two decode steps, "
        "so this bounds how long a generating row waits for embeddings.",
    )
    embed_share: float = Field(
        default=0.5, gt=0, le=1.0,
        description="Most of the engine thread's time embeddings take while rows decode "
        "(1 = no cap): under a steady embedding load, decoding keeps the rest. Measured "
        "here with 32-sentence requests back to back beside 8 rows, uncapped embeddings "
        "took 69% and the rows kept 0.29 of their tok/s. With no row decoding, embeddings "
        "run as soon as their batch is due.",
    )
    max_consecutive_step_failures: int = Field(
        default=3, ge=1,
        description="Model-step failures in a row before the engine declares itself dead.",
    )
    json_string_ngram: int = Field(
        default=4, ge=0,
        description="Inside JSON strings of constrained output (schemas, JSON mode, forced "
        "tool calls), refuse a token that repeats an n-gram of this many tokens already in "
        "that string: stops greedy loops, keeps greedy deterministic (0 = off).",
    )

    keep_alive: float | None = Field(
        default=None,
        description="Seconds the chat model stays loaded with no request running or queued; "
        "then the engine thread frees its weights, the in-memory prefix store and MLX's "
        "buffer cache (a prefix_cache_dir stays on disk), and the next request loads it "
        "again, waiting for that. 0 = unload as soon as the engine is idle; None = keep it "
        "loaded until close() (Ollama's keep_alive, LM Studio's TTL). A request may set its "
        "own (Engine.submit(..., keep_alive=...)): the latest request's applies.",
    )

    shard: Literal["tensor", "pipeline"] | None = Field(
        default=None,
        description="Split the model over the mx.distributed group (MLX_HOSTFILE + MLX_RANK, "
        "or mlx.launch): 'tensor' or 'pipeline'. Rank 0 runs the engine, the other ranks "
        "call engine.follow(). None = one process. Prefix reuse is off when sharded.",
    )
    distributed_timeout: float = Field(
        default=60.0, gt=0,
        description="Seconds one sharded step (its broadcast and the model's collectives) "
        "may take before rank 0 declares the engine dead (a follower stopped answering).",
    )

    @field_validator("prefix_cache_dir", mode="before")
    @classmethod
    def _directory_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive_not_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"keep_alive must be >= 0 seconds (0 unloads the model as soon "
                             f"as the engine is idle, None keeps it loaded), got {value!r}")
        return value

    @model_validator(mode="after")
    def _kv_bits_unrotated(self) -> EngineConfig:
        # A sliding window's ring is not quantized (mlx-lm keeps none): one or the other.
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise ValueError("kv_bits cannot be used with max_kv_size: a rotating KV cache "
                             "is not quantized; drop one of them")
        if self.kv_quantized_start:
            raise ValueError(
                f"kv_quantized_start={self.kv_quantized_start} is not served: the batch keeps "
                "one KV cache for all its rows, so switching it to quantized at a length "
                "would make a row's tokens depend on its siblings' lengths (batched would "
                "no longer equal alone); kv_bits quantizes every token from the first "
                "(8 bits: perplexity -0.07% on the default model); drop kv_quantized_start")
        if self.kv_bits is not None and self.kv_dtype is not None:
            raise ValueError("kv_bits and kv_dtype both set how KV is stored: quantized "
                             "blocks (kv_bits) or float16 (kv_dtype); drop one of them")
        return self

    @model_validator(mode="after")
    def _keep_alive_unsharded(self) -> EngineConfig:
        # Every rank would have to free and load its shard in step with rank 0.
        if self.keep_alive is not None and self.shard is not None:
            raise ValueError("keep_alive cannot be used with shard: a sharded engine keeps "
                             "its model loaded until close()")
        return self

    @field_validator("json_string_ngram")
    @classmethod
    def _ngram_of_two_or_more(cls, value: int) -> int:
        if value == 1:
            raise ValueError("json_string_ngram must be 0 (off) or >= 2")
        return value


def checked_engine_args(model: Any, config: Any) -> EngineConfig:
    """``Engine(model, config)``'s arguments checked on the caller's thread; the config.

    A wrong type here otherwise surfaced later on the engine thread, as an
    ``AttributeError`` from inside or as a dead engine.
    """
    if model is not None and not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be None (the default model), a path or a hub id, got "
                        f"{type(model).__name__} {model!r:.40}")
    if isinstance(model, str) and not model.strip():
        raise ValueError("model must not be empty: a path, a hub id, or None for the default")
    if config is None:
        return EngineConfig()
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig (EngineConfig(**fields)), got "
                        f"{type(config).__name__}")
    return config
