"""The compatibility matrix's features made real: requests, engines and events.

``engine.compatibility`` says which features go together; this module turns each into what a
caller does (a field of the request, an engine setting, a cancel at some stage) so the
matrix test (tests/engine/test_crossings.py) and the interaction fuzz
(tests/engine/test_fuzz_crossings.py) can run any set of them on one tiny model and check
that a row combining them is served exactly: batched equals alone, siblings keep their
tokens, and nothing is left behind.

The model is a tiny random Qwen2-VL (images on a grid of positions, the hardest family to
batch) with ``<think>``/``</think>`` in its vocabulary and a template that opens the
reasoning block when its ``think`` variable is set, so every request feature runs on it.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.compatibility import Feature, Kind

# ----- the model ---------------------------------------------------------------------------

THINK = ("<think>", "</think>")
MATRIX_MODEL = "matrix-qwen2_vl-v2"  # its directory name in a test cache (bump on change)
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
# Its own variable: mlx-lm sets ``enable_thinking`` for every model that can reason, and
# the matrix wants rows that answer at once beside rows that reason.
_OPENS_REASONING = ("{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
                    "{%- if think -%}{{- '<think>\n' -}}{%- endif -%}")
THINK_ON = {"think": True}


def build_matrix_vlm(out: Path) -> Path:
    """The tiny Qwen2-VL of ``testkit.vision_model``, able to reason: the thinking markers
    in its vocabulary and a template that opens the block when ``think`` is set."""
    from tokenizers import AddedToken, Tokenizer

    from testkit.vision_model import build_tiny_qwen2_vl

    build_tiny_qwen2_vl(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert all(tokenizer.token_to_id(t) < vocab for t in THINK), "no room for <think>"
    tokenizer.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert _GENERATION_PROMPT in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(_GENERATION_PROMPT,
                                                              _OPENS_REASONING)
    config_path.write_text(json.dumps(config, indent=2))
    return out


# ----- requests ----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 10}},
                   "required": ["city"]}}}
VERDICT = {"type": "object", "properties": {
    "answer": {"enum": ["sunny", "rainy"]}, "degrees": {"type": "integer", "maximum": 50}},
    "required": ["answer", "degrees"]}
# Long enough that its KV is worth storing: the head every request of the matrix shares.
SYSTEM = "You answer questions about the weather. " + " ".join(
    f"Rule {i}: keep it short and exact." for i in range(10))
QUESTION = "What is the weather in Paris?"
# A prompt long enough to be caught in its prefill (cancel_prefill), at 16 tokens a chunk.
FILLER = " ".join(f"note {i} about the sky." for i in range(80))


@dataclass
class Draft:
    """A request being put together feature by feature, and what happens to it."""

    question: str = QUESTION
    system: str = SYSTEM
    images: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_tokens": 12,
                                                              "temperature": 0.0})
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    cancel: str | None = None  # "prefill" or "decode": cancelled at that stage
    cancel_after: int = 3  # "decode": cancelled once this many tokens came
    # "prefill": a number that opens its filler, new for each draft, so no earlier row left
    # this prompt's KV to resume and the row is still prefilling when it is cancelled.
    filler_id: int = 0
    timeout: float | None = None
    embeddings: bool = False  # embedding requests run while it decodes
    features: frozenset[Feature] = frozenset()  # what it was made of (``draft_of``)

    @property
    def ends_early(self) -> bool:
        """Cancelled or timed out: its tokens are a prefix of its run to the end."""
        return self.cancel is not None or self.timeout is not None

    def messages(self) -> list[dict[str, Any]]:
        text = (f"Case {self.filler_id}. {FILLER}\n{self.question}" if self.cancel == "prefill"
                else self.question)
        content: Any = [*self.images, {"type": "text", "text": text}] if self.images else text
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": content}]

    def request(self) -> Any:
        from engine import ChatRequest, SamplingParams

        return ChatRequest.from_openai(self.messages(), SamplingParams(**self.sampling),
                                       tools=self.tools, tool_choice=self.tool_choice,
                                       chat_template_kwargs=self.template_kwargs)

    def to_the_end(self) -> Draft:
        """The same request, neither cancelled nor timed out (its reference)."""
        return replace(self, cancel=None, cancel_after=3, filler_id=0, timeout=None,
                       embeddings=False)


@dataclass(frozen=True)
class Assets:
    """Files the features need: the model, an adapter for it, an embedding model."""

    model: Path
    adapter: str
    embedding_model: Path | None = None


def image_part(rgb: tuple[int, int, int], seed: int = 0, size: int = 60) -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding a noisy PNG of one colour."""
    from testkit.vision_model import solid_image

    data = solid_image(rgb, size, noise=20, seed=seed)
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _set(**sampling: Any) -> Callable[[Draft, Assets], None]:
    def apply(draft: Draft, assets: Assets) -> None:
        draft.sampling.update(sampling)
    return apply


def _constraint(make: Callable[[], Any]) -> Callable[[Draft, Assets], None]:
    def apply(draft: Draft, assets: Assets) -> None:
        draft.sampling["constraint"] = make()
    return apply


def _tools(choice: Any, *tools: dict[str, Any]) -> Callable[[Draft, Assets], None]:
    def apply(draft: Draft, assets: Assets) -> None:
        draft.tools, draft.tool_choice = list(tools), choice
        draft.sampling["max_tokens"] = 60  # a whole call
    return apply


def _images(draft: Draft, assets: Assets) -> None:
    draft.images = [image_part((30, 40, 220), seed=len(draft.question))]


def _adapter(draft: Draft, assets: Assets) -> None:
    draft.sampling["adapter"] = assets.adapter


def _budget(draft: Draft, assets: Assets) -> None:
    draft.template_kwargs = dict(THINK_ON)
    draft.sampling.update(reasoning_budget=3, max_tokens=16)


def _tools_and_schema(draft: Draft, assets: Assets) -> None:
    from engine import JsonSchema

    _tools("auto", WEATHER)(draft, assets)
    draft.sampling["constraint"] = JsonSchema(VERDICT)


def _stream(draft: Draft, assets: Assets) -> None:
    draft.stream = True


_FILLER_IDS = itertools.count(1)


def _cancel(stage: str) -> Callable[[Draft, Assets], None]:
    def apply(draft: Draft, assets: Assets) -> None:
        draft.cancel = stage
        if stage == "prefill":
            draft.filler_id = next(_FILLER_IDS)
        draft.sampling["max_tokens"] = max(draft.sampling["max_tokens"], 16)
    return apply


def _timeout(draft: Draft, assets: Assets) -> None:
    draft.timeout = 0.03
    draft.sampling["max_tokens"] = max(draft.sampling["max_tokens"], 48)


def _embeddings(draft: Draft, assets: Assets) -> None:
    draft.embeddings = True


def _json_schema() -> Any:
    from engine import JsonSchema

    return JsonSchema(VERDICT)


def _regex() -> Any:
    from engine import Regex

    return Regex(r"(yes|no), [a-z]{1,8}")


def _lark() -> Any:
    from engine import LarkGrammar

    # Several tokens on any machine (a cancel after the third lands), with a forced stretch.
    return LarkGrammar('start: ("yes" | "no" | "maybe so") " because it is " '
                       '("sunny" | "raining" | "late")')


# How each request feature and event is written into a request.
APPLY: dict[Feature, Callable[[Draft, Assets], None]] = {
    Feature.IMAGES: _images,
    Feature.ADAPTER: _adapter,
    Feature.LOGPROBS: _set(logprobs=True, top_logprobs=2),
    Feature.TOOLS_AUTO: _tools("auto", WEATHER, TIME),
    Feature.TOOLS_REQUIRED: _tools("required", WEATHER, TIME),
    Feature.TOOLS_NAMED: _tools({"type": "function", "function": {"name": "get_weather"}},
                                WEATHER, TIME),
    Feature.SCHEMA: _constraint(_json_schema),
    Feature.REGEX: _constraint(_regex),
    Feature.LARK: _constraint(_lark),
    Feature.TOOLS_AND_SCHEMA: _tools_and_schema,
    Feature.REASONING_BUDGET: _budget,
    Feature.STOP: _set(stop=["e"]),
    Feature.SEED: _set(temperature=0.9, seed=11),
    Feature.STREAM: _stream,
    Feature.CANCEL_PREFILL: _cancel("prefill"),
    Feature.CANCEL_DECODE: _cancel("decode"),
    Feature.TIMEOUT: _timeout,
    Feature.EMBEDDINGS: _embeddings,
}

# Features that never change a row's tokens: a row with one equals the row without it.
# Quantized and float16 KV are engine modes that do change them (attention reads rounded
# keys and values), so a row on a kv_bits (kv_dtype) engine is compared with rows on such an
# engine only.
ROUNDS_KV = frozenset({Feature.KV_BITS, Feature.KV_DTYPE})
NEUTRAL = frozenset({Feature.LOGPROBS, Feature.STREAM, Feature.EMBEDDINGS,
                     *(f for f in Feature if f.kind is Kind.ENGINE and f not in ROUNDS_KV)})


def draft_of(features: Collection[Feature], assets: Assets, question: str = QUESTION,
             system: str = SYSTEM) -> Draft:
    """A request with the request features and events among ``features`` (engine modes
    are the engine's: ``engine_config``)."""
    draft = Draft(question=question, system=system, features=frozenset(features))
    for feature in sorted(features, key=lambda f: list(Feature).index(f)):
        apply = APPLY.get(feature)
        if apply is not None:
            apply(draft, assets)
    return draft


# ----- engines -----------------------------------------------------------------------------

# Every speed-up off: each engine feature turns one on.
BASE_CONFIG: dict[str, Any] = {"max_batch": 8, "prefill_chunk": 16, "fast_forward": False,
                               "speculation": 0, "prefix_cache_bytes": 0}
_CONFIG: dict[Feature, dict[str, Any]] = {
    Feature.SPECULATION: {"speculation": 8},
    Feature.FAST_FORWARD: {"fast_forward": True},
    Feature.PREFIX_MEMORY: {"prefix_cache_bytes": 64 << 20},
    Feature.PREFIX_DISK: {"prefix_cache_bytes": 64 << 20},  # and a directory of its own
    Feature.KEEP_ALIVE: {"keep_alive": 0.0},
    # Groups of 32: the tiny models' heads are 32 wide (the default 64 would not divide).
    Feature.KV_BITS: {"kv_bits": 8, "kv_group_size": 32},
    Feature.KV_DTYPE: {"kv_dtype": "float16"},
}


def engine_features(features: Collection[Feature]) -> frozenset[Feature]:
    return frozenset(f for f in features if f.kind is Kind.ENGINE)


def engine_config(features: Collection[Feature], disk_dir: Path | None = None,
                  ) -> dict[str, Any]:
    """The EngineConfig fields of the engine modes among ``features``."""
    config = dict(BASE_CONFIG)
    for feature in engine_features(features):
        config.update(_CONFIG.get(feature, {}))
    if Feature.PREFIX_DISK in features:
        assert disk_dir is not None, "the disk tier needs a directory"
        config["prefix_cache_dir"] = str(disk_dir)
    return config


@contextlib.contextmanager
def runs_serially(model_type: str) -> Iterator[None]:
    """While an engine loads inside, its model's rows are sent to the serial lane, as a
    model whose caches cannot batch is (its tokens unchanged: same caches, one row each)."""
    from engine.device.loading.padding_probe import KNOWN_DIVERGENT

    KNOWN_DIVERGENT[model_type] = "a test: caches that cannot batch"
    try:
        yield
    finally:
        del KNOWN_DIVERGENT[model_type]


# ----- running rows ------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What one row gave back."""

    tokens: tuple[int, ...]
    finish: str
    text: str = ""
    logprobs: int = 0  # tokens with logprobs
    streamed: tuple[int, ...] | None = None  # the tokens its stream's events carried
    error: str = ""  # the failure's type and message


class Admissions:
    """A probe's ``on_turn``: cancels a row the turn it is admitted (caught in its prefill),
    when armed with its handle."""

    def __init__(self) -> None:
        self.waiting: dict[int, Any] = {}  # request id -> handle to cancel once admitted
        self.cancelled_in_prefill: set[int] = set()

    def __call__(self, report: Any) -> None:
        for request_id in report.admitted:
            handle = self.waiting.pop(request_id, None)
            if handle is not None:
                self.cancelled_in_prefill.add(request_id)
                handle.cancel()


def run_rows(eng: Any, drafts: list[Draft], admissions: Admissions | None = None,
             embed: Callable[[], None] | None = None) -> list[Outcome]:
    """Submit ``drafts`` together (one batch where they can be), let each be cancelled as
    it says, and return every row's outcome in order."""
    from engine import FinishReason, RequestTimeoutError

    handles: list[Any] = []
    decoded: list[list[int]] = [[] for _ in drafts]
    for i, draft in enumerate(drafts):
        on_token = None
        if draft.cancel == "decode":
            def on_token(token: int, text: str, i: int = i, after: int = draft.cancel_after,
                         ) -> bool:
                decoded[i].append(token)
                if len(decoded[i]) == after:
                    handles[i].cancel()
                return True
        if draft.cancel == "prefill":
            assert admissions is not None, "cancel_prefill needs the engine's Admissions"
        handle = eng.submit(draft.request(), on_token=on_token, timeout=draft.timeout)
        if draft.cancel == "prefill" and admissions is not None:
            admissions.waiting[handle.request_id] = handle
        handles.append(handle)
    stop = threading.Event()
    embedder = None
    if embed is not None and any(d.embeddings for d in drafts):
        def embedding() -> None:
            while not stop.is_set():
                embed()
        embedder = threading.Thread(target=embedding, daemon=True)
        embedder.start()
    outcomes = []
    try:
        for draft, handle in zip(drafts, handles):
            try:
                result = handle.result(timeout=120)
            except RequestTimeoutError as exc:  # its own timeout: a typed failure
                outcomes.append(Outcome((), FinishReason.ERROR.value,
                                        error=f"{type(exc).__name__}: {exc}"))
                continue
            except TimeoutError as exc:  # the row never ended: a hang, which fails loudly
                state = engine_state(eng)
                print("HUNG", draft, state, flush=True)
                raise TimeoutError(f"{exc}; the engine then: {state}") from exc
            except Exception as exc:  # a typed failure: its outcome says which
                outcomes.append(Outcome((), FinishReason.ERROR.value,
                                        error=f"{type(exc).__name__}: {exc}"))
                continue
            # Its events stay queued until read: read after the end, none is lost.
            streamed = tuple(_streamed_tokens(handle)) if draft.stream else None
            outcomes.append(Outcome(
                tuple(result.token_ids), result.finish_reason.value, result.text,
                len(result.logprobs or ()), streamed))
    finally:
        stop.set()
        if embedder is not None:
            embedder.join(timeout=60)
    return outcomes


def _streamed_tokens(handle: Any) -> Iterator[int]:
    with contextlib.suppress(Exception):  # a timed-out stream raises after its last event
        for event in handle:
            yield from event.token_ids


def settled(eng: Any, timeout: float = 30.0) -> Mapping[str, int]:
    """Once the engine is idle: what its rows held that is still held (all zero when
    nothing was left behind: rows, grammar matchers, KV, image jobs, pinned adapters)."""
    deadline = time.monotonic() + timeout
    while True:
        left = _held(eng)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _held(eng: Any) -> dict[str, int]:
    stats = eng.stats()
    held = {"running": stats.running, "pending": stats.pending,
            "live_matchers": stats.live_matchers, "kv_bytes": stats.kv_bytes_projected,
            "kv_bytes_held": stats.kv_bytes_held,
            "vision_jobs": stats.vision_jobs, "adapters_in_use": stats.adapters_in_use}
    return held


class KVDtypes:
    """A probe's ``on_lanes`` and ``on_step``: before each lane step, the dtypes of the keys
    and values its rows' caches hold (the batch lane's generator, prompts and decoding rows;
    the serial lane's rows), by name ("float16")."""

    def __init__(self) -> None:
        self.lanes: Any = None
        self.seen: set[str] = set()

    def built(self, lanes: Any) -> None:
        self.lanes = lanes

    def __call__(self, lane: str) -> None:
        lanes = self.lanes
        if lanes is None:
            return
        if lane == "batch":
            generator = lanes.batch.generator
            caches = [generator._prompt_batch.prompt_cache,
                      generator._generation_batch.prompt_cache]
        else:
            caches = [row.cache for row in lanes.serial._rows.values()]
        for cache in caches:
            self._walk(cache)

    def _walk(self, layers: Any) -> None:
        for layer in layers or ():
            inner = getattr(layer, "caches", None)
            if inner is not None:  # a cache of caches (mlx-lm's CacheList)
                self._walk(inner)
                continue
            for part in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                dtype = getattr(part, "dtype", None)
                if dtype is not None:
                    self.seen.add(str(dtype).removeprefix("mlx.core."))


@dataclass
class Served:
    """An engine of the matrix (or the fuzz), the admissions it reports, and the rows it has
    already run alone (``kv_dtypes``: on a kv_dtype engine, the KV dtypes its rows held)."""

    engine: Any
    admissions: Admissions
    embedding_model: Path | None = None
    alone_runs: dict[str, Outcome] = field(default_factory=dict)
    kv_dtypes: KVDtypes | None = None

    def run(self, drafts: list[Draft]) -> list[Outcome]:
        """``drafts`` submitted together (embedding requests beside them where asked)."""
        embed = None
        if self.embedding_model is not None:
            model = self.embedding_model

            def embed() -> None:
                self.engine.embed(["sunny skies", "rain in Paris"], model).result(timeout=60)
        return run_rows(self.engine, drafts, self.admissions, embed)

    def alone(self, draft: Draft) -> Outcome:
        """The row run by itself on this engine (once; remembered)."""
        key = repr(draft)
        if key not in self.alone_runs:
            self.alone_runs[key] = self.run([draft])[0]
        return self.alone_runs[key]


def start_engine(model: Path, config: Mapping[str, Any], *, serial: str | None = None,
                 embedding_model: Path | None = None, eager_spans: bool = False) -> Served:
    """An engine whose probe cancels rows in their prefill on demand; ``serial``: the
    model type whose rows it sends to the serial lane; ``eager_spans``: fast-forward takes
    every forced span, whatever this machine's step costs say (the matrix proves that spans
    cross other features exactly; tests/unit/test_step_costs.py proves when they pay)."""
    from engine import Engine, EngineConfig, StepProbe

    admissions = Admissions()
    kv_dtypes = KVDtypes() if config.get("kv_dtype") else None
    probe = (StepProbe(on_turn=admissions) if kv_dtypes is None else
             StepProbe(on_turn=admissions, on_step=kv_dtypes, on_lanes=kv_dtypes.built))
    eng = Engine(model, EngineConfig(**config), probe=probe)
    if serial is not None:
        with runs_serially(serial):
            eng.start()
        assert eng.stats().batch_mode == "serial"
    else:
        eng.start()
    composition = eng._runtime.composition
    if eager_spans and composition is not None:  # (one that unloads when idle: as shipped)
        composition.built.lanes.batch.costs.shortest = lambda spans, width, rows: 2
    return Served(eng, admissions, embedding_model, kv_dtypes=kv_dtypes)


def engine_state(eng: Any) -> str:
    """What a hung engine holds, for the failure's message: its figures and its rows."""
    stats = eng.stats()
    parts = [f"running={stats.running} pending={stats.pending} steps={stats.steps} "
             f"generated={stats.generated_tokens} vision_jobs={stats.vision_jobs}"]
    composition = getattr(eng._runtime, "composition", None)
    if composition is not None:
        lanes = composition.built.lanes
        for row in list(lanes.batch.rows):
            parts.append(f"batch row {row.request_id}: uid={row.uid} generated={row.generated} "
                         f"speculating={row.speculating is not None} "
                         f"vision_ready={row.vision_ready is not None} "
                         f"max_tokens={row.row.params.max_tokens}")
        parts.append(f"serial rows={len(lanes.serial)}")
    return "; ".join(parts)
