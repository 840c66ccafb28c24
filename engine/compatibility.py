"""Which request features and engine modes go together: the compatibility matrix, as data.

Every pair of features is one of three things:

- **served**: the pair runs exactly: a row with both equals itself run alone, and equals the
  row with one of them where the other does not change tokens;
- **inert**: served exactly, but one of the two does nothing for that row, for a reason
  given here (a seeded row runs alone, so speculation does not apply to it);
- **refused**: ``Engine.submit`` raises ``UnsupportedCombinationError`` naming both, with
  the reason given here.

Pairs not listed are served. The engine refuses by this table (``refusal``), the generated
matrix test runs every pair of it, and docs/compatibility.md is written from it
(``python -m engine.compatibility``), so the three cannot drift apart. No mlx.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from itertools import combinations

from engine.errors import UnsupportedCombinationError
from engine.requests.inbound.text_request import Request


class Kind(Enum):
    """Where a feature comes from."""

    REQUEST = "request"  # a field of the request
    ENGINE = "engine"  # how the engine is configured, or what its model's caches allow
    EVENT = "event"  # something that happens to a request while it runs


class Feature(Enum):
    """A request feature, an engine mode or an event, by the name the matrix uses."""

    IMAGES = "images"
    ADAPTER = "adapter"
    LOGPROBS = "logprobs"
    TOOLS_AUTO = "tools_auto"
    TOOLS_REQUIRED = "tools_required"
    TOOLS_NAMED = "tools_named"
    SCHEMA = "schema"
    REGEX = "regex"
    LARK = "lark"
    TOOLS_AND_SCHEMA = "tools_and_schema"
    REASONING_BUDGET = "reasoning_budget"
    STOP = "stop"
    SEED = "seed"
    STREAM = "stream"
    SPECULATION = "speculation"
    FAST_FORWARD = "fast_forward"
    PREFIX_MEMORY = "prefix_memory"
    PREFIX_DISK = "prefix_disk"
    KEEP_ALIVE = "keep_alive"
    KV_BITS = "kv_bits"
    KV_DTYPE = "kv_dtype"
    SERIAL = "serial"
    SHARDED_TENSOR = "sharded_tensor"
    SHARDED_PIPELINE = "sharded_pipeline"
    CANCEL_PREFILL = "cancel_prefill"
    CANCEL_DECODE = "cancel_decode"
    TIMEOUT = "timeout"
    EMBEDDINGS = "embeddings"

    @property
    def kind(self) -> Kind:
        return _KINDS[self]

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES = {
    Feature.IMAGES: "images in the prompt (or a tool result)",
    Feature.ADAPTER: "a LoRA adapter (`adapter`)",
    Feature.LOGPROBS: "`logprobs` and `top_logprobs`",
    Feature.TOOLS_AUTO: "tools, `tool_choice` auto",
    Feature.TOOLS_REQUIRED: "tools, `tool_choice` required",
    Feature.TOOLS_NAMED: "tools, `tool_choice` naming one",
    Feature.SCHEMA: "a response JSON schema",
    Feature.REGEX: "a regular expression",
    Feature.LARK: "a Lark grammar",
    Feature.TOOLS_AND_SCHEMA: "tools beside a response schema",
    Feature.REASONING_BUDGET: "`reasoning_budget`",
    Feature.STOP: "stop strings",
    Feature.SEED: "a seed (temperature > 0)",
    Feature.STREAM: "streamed (tokens as they come)",
    Feature.SPECULATION: "prompt-lookup speculation (`speculation`)",
    Feature.FAST_FORWARD: "grammar fast-forward (`fast_forward`)",
    Feature.PREFIX_MEMORY: "prefix reuse in memory",
    Feature.PREFIX_DISK: "prefix reuse's disk tier (`prefix_cache_dir`)",
    Feature.KEEP_ALIVE: "`keep_alive` unload and reload",
    Feature.KV_BITS: "quantized KV (`kv_bits=8`)",
    Feature.KV_DTYPE: "float16 KV (`kv_dtype=\"float16\"`)",
    Feature.SERIAL: "the serial lane (caches that cannot batch)",
    Feature.SHARDED_TENSOR: "sharded, tensor parallel",
    Feature.SHARDED_PIPELINE: "sharded, pipeline parallel",
    Feature.CANCEL_PREFILL: "cancelled in prefill",
    Feature.CANCEL_DECODE: "cancelled while decoding",
    Feature.TIMEOUT: "a `timeout` that expires",
    Feature.EMBEDDINGS: "embeddings run between steps",
}

_KINDS = {
    **{f: Kind.REQUEST for f in (
        Feature.IMAGES, Feature.ADAPTER, Feature.LOGPROBS, Feature.TOOLS_AUTO,
        Feature.TOOLS_REQUIRED, Feature.TOOLS_NAMED, Feature.SCHEMA, Feature.REGEX,
        Feature.LARK, Feature.TOOLS_AND_SCHEMA, Feature.REASONING_BUDGET, Feature.STOP,
        Feature.SEED, Feature.STREAM)},
    **{f: Kind.ENGINE for f in (
        Feature.SPECULATION, Feature.FAST_FORWARD, Feature.PREFIX_MEMORY,
        Feature.PREFIX_DISK, Feature.KEEP_ALIVE, Feature.KV_BITS, Feature.KV_DTYPE,
        Feature.SERIAL,
        Feature.SHARDED_TENSOR, Feature.SHARDED_PIPELINE)},
    **{f: Kind.EVENT for f in (
        Feature.CANCEL_PREFILL, Feature.CANCEL_DECODE, Feature.TIMEOUT, Feature.EMBEDDINGS)},
}

SHARDED = (Feature.SHARDED_TENSOR, Feature.SHARDED_PIPELINE)
# One constraint a row: a schema, a regex, a grammar, forced or offered calls.
CONSTRAINTS = (Feature.TOOLS_AUTO, Feature.TOOLS_REQUIRED, Feature.TOOLS_NAMED,
               Feature.SCHEMA, Feature.REGEX, Feature.LARK, Feature.TOOLS_AND_SCHEMA)
CANCELS = (Feature.CANCEL_PREFILL, Feature.CANCEL_DECODE, Feature.TIMEOUT)


class Status(Enum):
    SERVED = "served"
    INERT = "inert"
    REFUSED = "refused"
    EXCLUSIVE = "exclusive"  # the two are alternatives: a request has one or the other


@dataclass(frozen=True)
class Verdict:
    """What the engine does with a pair, and why when it is not simply served."""

    status: Status
    reason: str = ""
    inert: Feature | None = None  # INERT: the feature that does nothing for the row


_REFUSED: dict[frozenset[Feature], str] = {}
_INERT: dict[frozenset[Feature], tuple[Feature, str]] = {}
_EXCLUSIVE: dict[frozenset[Feature], str] = {}


def _refuse(a: Feature, b: Feature, reason: str) -> None:
    _REFUSED[frozenset((a, b))] = reason


def _inert(feature: Feature, beside: Feature, reason: str) -> None:
    _INERT[frozenset((feature, beside))] = (feature, reason)


for _sharded in SHARDED:
    _refuse(_sharded, Feature.IMAGES,
            "the vision tower runs on one process only: a sharded engine reads no images")
    _refuse(_sharded, Feature.ADAPTER,
            "per-row adapters are not split across ranks: a tensor-parallel layer would "
            "need its low-rank pair split and one more all-reduce per layer, and every rank "
            "to load the adapter in step; serve a fused copy instead")
    _refuse(_sharded, Feature.KEEP_ALIVE,
            "a sharded engine keeps its model loaded until close(): its ranks load together")
    for _reuse in (Feature.PREFIX_MEMORY, Feature.PREFIX_DISK):
        _inert(_reuse, _sharded, "prefix reuse is off on a sharded engine: the store's "
                                 "expiry and shrinking depend on each rank's clock and memory")
_EXCLUSIVE[frozenset(SHARDED)] = "an engine is sharded one way"
_refuse(Feature.KV_BITS, Feature.KV_DTYPE,
        "both set how KV is stored: quantized blocks (kv_bits) or float16 (kv_dtype); "
        "EngineConfig refuses the two together")
for _a, _b in combinations(CONSTRAINTS, 2):
    _EXCLUSIVE[frozenset((_a, _b))] = "a request has one tool choice and one output format"
for _a, _b in combinations(CANCELS, 2):
    _EXCLUSIVE[frozenset((_a, _b))] = "a row ends once"
for _quiet in (Feature.SERIAL, Feature.SEED):
    for _speedup in (Feature.SPECULATION, Feature.PREFIX_MEMORY, Feature.PREFIX_DISK):
        _inert(_speedup, _quiet, "a row on the serial lane runs alone on its own cache: "
                                 "no drafts are checked and no prefix is stored or resumed")


def verdict(a: Feature, b: Feature) -> Verdict:
    """What the engine does with a request (or engine) that has both ``a`` and ``b``."""
    pair = frozenset((a, b))
    if pair in _REFUSED:
        return Verdict(Status.REFUSED, _REFUSED[pair])
    if pair in _EXCLUSIVE:
        return Verdict(Status.EXCLUSIVE, _EXCLUSIVE[pair])
    if pair in _INERT:
        feature, reason = _INERT[pair]
        return Verdict(Status.INERT, reason, feature)
    return Verdict(Status.SERVED)


def pairs() -> list[tuple[Feature, Feature, Verdict]]:
    """Every pair of distinct features, in the table's order, with its verdict."""
    return [(a, b, verdict(a, b)) for a, b in combinations(Feature, 2)]


def refusal(features: Collection[Feature]) -> tuple[Feature, Feature, str] | None:
    """The first refused pair among ``features`` (a request's and its engine's), if any."""
    for a, b in combinations(sorted(features, key=_ORDER.__getitem__), 2):
        reason = _REFUSED.get(frozenset((a, b)))
        if reason is not None:
            return a, b, reason
    return None


_ORDER = {feature: i for i, feature in enumerate(Feature)}


def submitted_features(request: Request, shard: str | None, keep_alive: bool,
                       ) -> dict[Feature, str]:
    """The features ``submit`` can see that a refusal may name, each with the field it
    names in the error (what the caller set): images, an adapter, keep_alive, sharding."""
    found: dict[Feature, str] = {}
    for i, message in enumerate(getattr(request, "messages", ())):
        if message.images:
            found[Feature.IMAGES] = f"messages[{i}].content"
            break
    if request.params.adapter is not None:
        found[Feature.ADAPTER] = "adapter"
    if keep_alive:
        found[Feature.KEEP_ALIVE] = "keep_alive"
    if shard is not None:
        found[Feature(f"sharded_{shard}")] = "shard"
    return found


def check_combination(request: Request, shard: str | None, keep_alive: bool) -> None:
    """Raise ``UnsupportedCombinationError`` naming both features of the first pair the
    table refuses (the request's own field, not the engine's, where one is the request's)."""
    features = submitted_features(request, shard, keep_alive)
    refused = refusal(features)
    if refused is None:
        return
    a, b, reason = refused
    field = features[a] if features[a] != "shard" else features[b]
    raise UnsupportedCombinationError(
        f"{a.value} and {b.value} are not served together: {reason} "
        "(docs/compatibility.md)", field, (a.value, b.value))
