"""A family's real tokenizer and a tiny random-weight model of its real architecture.

``family_tokenizer`` builds the family's tokenizer from its vocabulary source and places its
added tokens; ``build_family_model`` writes a model directory that ``mlx_lm.load`` and the
engine load: hidden width 64, the real vocabulary size, the published chat template, the
tokenizer_config and generation_config a real checkpoint carries. Tokenizers are cached as
``tokenizer.json`` by content, so only the first session pays the seconds a 200k-token
vocabulary takes to convert.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from testkit import architectures
from testkit.families import assets, vocabularies
from testkit.families.catalog import Family


def _base_vocabulary(family: Family) -> Tokenizer:
    """The family's vocabulary before its own added tokens."""
    vocabulary = family.vocabulary
    if vocabulary.kind == "gguf":
        return vocabularies.from_gguf(assets.vocab_file(vocabulary.name))
    if vocabulary.kind == "tiktoken":
        path = assets.o200k_file() if vocabulary.name == "o200k" else assets.cl100k_file()
        split = vocabularies.O200K_SPLIT if vocabulary.name == "o200k" else (
            vocabularies.CL100K_SPLIT)
        return vocabularies.from_ranks(vocabularies.tiktoken_ranks(path), split)
    if vocabulary.kind == "tekken":
        path = assets.tekken_dir() / f"{vocabulary.name}.json"
        ranks, split, specials = vocabularies.tekken_ranks(path, family.vocab_size)
        return vocabularies.from_ranks(ranks, split, offset=specials)
    raise ValueError(f"{family.name}: unknown vocabulary kind {vocabulary.kind!r}")


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


# A family's fields that the tests read and no build does: editing them rebuilds nothing.
_NOT_BUILT = frozenset({"title", "expected"})


def _source_key(family: Family) -> str:
    """Changes when what builds the family's model does: its entry's build fields, or the
    code building it."""
    built = {f.name: getattr(family, f.name) for f in fields(family) if f.name not in _NOT_BUILT}
    return _key(repr(built), inspect.getsource(vocabularies), inspect.getsource(Family),
                inspect.getsource(architectures), inspect.getsource(_model_config))


def family_tokenizer(family: Family, cache: Path | None = None) -> Tokenizer:
    """The family's tokenizer: its vocabulary with its added tokens at their ids."""
    root = cache or assets.assets_root()
    path = root / "tokenizers" / f"{family.name}-{_source_key(family)}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = vocabularies.with_added_tokens(_base_vocabulary(family), family.added)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".tmp{os.getpid()}")
    tokenizer.save(str(partial))
    os.replace(partial, path)  # whole or not at all
    for stale in path.parent.glob(f"{family.name}-*.json"):
        if stale != path and len(stale.stem) == len(path.stem):  # an older build's key
            stale.unlink(missing_ok=True)
    return tokenizer


def _model_config(family: Family, tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json: the architecture's tiny config, the family's settings, its eos ids."""
    config = architectures.tiny_config(family.model_type, family.vocab_size)
    config.update(copy.deepcopy(family.config))
    if family.text_config is not None:
        text = dict(config.get("text_config") or {})
        text.update(copy.deepcopy(family.text_config))
        if text.get("model_type") in architectures.MODEL_REMAPS:
            # A wrapper whose text model is another architecture (mistral3 over llama).
            text = {**architectures.tiny_config(
                architectures.MODEL_REMAPS.get(text["model_type"], text["model_type"]),
                family.vocab_size), **text}
        text["vocab_size"] = family.vocab_size
        config["text_config"] = text
    eos = [tokenizer.token_to_id(token) for token in family.eos]
    config["eos_token_id"] = [token_id for token_id in eos if token_id is not None]
    return config


def _tokenizer_config(family: Family) -> dict[str, Any]:
    """tokenizer_config.json as the published checkpoint has it, with its chat template."""
    return {
        **family.tokenizer_config,
        # Loaded as the tokenizer.json written here: transformers' model-specific classes
        # would rebuild their own normalizer and pre-tokenizer around the vocabulary.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": assets.template(family.template),
    }


def build_family_model(family: Family, out: Path, *, seed: int = 0,
                       weight_scale: float = 2.0) -> Path:
    """Write the family's tiny model directory to ``out`` (created) and return it."""
    tokenizer = family_tokenizer(family)
    config = _model_config(family, tokenizer)
    architectures.save_random_model(config, out, seed=seed, weight_scale=weight_scale,
                                    max_params=60_000_000)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = _tokenizer_config(family)
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8")
    special = {key: value for key, value in tokenizer_config.items()
               if key.endswith("_token") and value is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special, ensure_ascii=False),
                                                 encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"]}))
    return out


def family_model_key(family: Family) -> str:
    """A directory name for the family's model that changes with anything that builds it."""
    return f"{family.name}-{_key(_source_key(family), assets.template(family.template))}"


def built_family_model(family: Family, root: Path) -> Path:
    """The family's model under ``root``, built once and published by rename (a crashed
    build never looks finished; a changed catalog or template builds a new one)."""
    from engine.models.user_cache import exclusive_lock

    out = root / "families" / family_model_key(family)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out.parent / f".{out.name}.lock"):
        if not (out / "config.json").is_file():
            partial = out.with_name(out.name + f".tmp{os.getpid()}")
            build_family_model(family, partial)
            os.replace(partial, out)
    return out
